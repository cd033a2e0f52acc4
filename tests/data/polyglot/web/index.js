'use strict';

// Slugify a title: lower case, words joined by dashes.
function slugify(title) {
  return title
    .toLowerCase()
    .replace(/[^a-z0-9]+/g, '-')
    .replace(/^-+|-+$/g, '');
}

module.exports = { slugify };

if (require.main === module) {
  console.log(slugify('Hello, World: a Tiny Package!'));
}
