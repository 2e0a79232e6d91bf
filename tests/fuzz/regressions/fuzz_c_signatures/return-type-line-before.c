void
k(int* a, int n) { a[0] = n; }
/* } */ { ( 
