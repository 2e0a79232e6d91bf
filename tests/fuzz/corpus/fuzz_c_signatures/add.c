void add(float* restrict o, const float* restrict a, const float* restrict b, int n) {
  for (int i = 0; i < n; i++) o[i] = a[i] + b[i];
}
