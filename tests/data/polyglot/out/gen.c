/* generated: ignored by out/ in the .gitignore */
int generated_value(void) { return 42; }
