#include <stdint.h>
typedef float float4 __attribute__((ext_vector_type(4)));
static inline float helper(float x) { return x * 2; }
void r_16_4(float* restrict data0, const float* restrict data1, int core_id) {
  float4 acc0 = (float4){0.0f,0.0f,0.0f,0.0f};
  for (int ridx0 = 0; ridx0 < 16; ridx0++) { acc0 += *((float4*)(data1+ridx0*4)); }
  data0[core_id] = acc0[0] + acc0[1];
}
void E_4(int* data0, int val) { data0[0] = val; }
