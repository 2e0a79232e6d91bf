/* void commented(int* a) { } */
void
split_line(int* a,
 int n) { a[0] = n; }
#if 0
void hidden(int* a) {}
#endif
const char* s = "void str(int* a) {";
