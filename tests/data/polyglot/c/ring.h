/* ring.h: a fixed-size ring buffer of bytes. */
#ifndef RING_H
#define RING_H

#include <stddef.h>

typedef struct {
    unsigned char *data;
    size_t capacity;
    size_t head;
    size_t count;
} ring_t;

int ring_init(ring_t *r, size_t capacity);
void ring_free(ring_t *r);
int ring_push(ring_t *r, unsigned char byte);
int ring_pop(ring_t *r, unsigned char *byte);

#endif /* RING_H */
