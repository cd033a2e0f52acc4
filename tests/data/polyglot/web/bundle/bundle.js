function slugify(t){return t.toLowerCase()}
