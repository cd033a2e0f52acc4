/* ring.c: a fixed-size ring buffer of bytes. */
#include <stdlib.h>
#include "ring.h"

int ring_init(ring_t *r, size_t capacity) {
    if (capacity == 0) {
        return -1;
    }
    r->data = malloc(capacity);
    if (r->data == NULL) {
        return -1;
    }
    r->capacity = capacity;
    r->head = 0;
    r->count = 0;
    return 0;
}

void ring_free(ring_t *r) {
    free(r->data);
    r->data = NULL;
    r->capacity = r->head = r->count = 0;
}

int ring_push(ring_t *r, unsigned char byte) {
    if (r->count == r->capacity) {
        return -1; /* full */
    }
    r->data[(r->head + r->count) % r->capacity] = byte;
    r->count++;
    return 0;
}

int ring_pop(ring_t *r, unsigned char *byte) {
    if (r->count == 0) {
        return -1; /* empty */
    }
    *byte = r->data[r->head];
    r->head = (r->head + 1) % r->capacity;
    r->count--;
    return 0;
}
