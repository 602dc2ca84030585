/* The benchmark's memory floor: out[i, t] = mask[i, t] ? (float)ids[i, t] : 0, the least any KTAE
 * implementation must do (read the int64 ids and the bool mask once, write float32 once).
 * Compiled at bench time by bench/floor.py (cc -O3 -fopenmp) and loaded with ctypes; never shipped. */
#include <stdint.h>

void ktae_floor(const int64_t* ids, int64_t ids_stride, const uint8_t* mask, int64_t mask_stride, int64_t B,
                int64_t L, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < B; ++i)
    for (int64_t t = 0; t < L; ++t)
      out[i * L + t] = mask[i * mask_stride + t] ? (float)ids[i * ids_stride + t] : 0.0f;
}

/* 1 when built with OpenMP: without it the pass runs on one thread whatever `threads` says, which is no floor
 * for backends on several threads (bench/floor.py then measures none). */
int ktae_floor_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
