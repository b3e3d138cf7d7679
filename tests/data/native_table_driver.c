/* Drives psg's EmbeddingBag kernels (psg_core/csrc/table.h) on random bag layouts, valid and not
 * (empty bags, padding, tokens outside the table, offsets past the input, entries outside their
 * sample's rows, inf rows, one and two threads), and its float64 Gram kernel (gram.h) on random
 * shapes and strides against a plain double loop, for tests/core/test_native_sanitized.py, which
 * builds it with AddressSanitizer and UBSan: any out-of-bounds access, leak or undefined
 * behaviour aborts the run. Exits 1 where a kernel refused numbers it should have taken. */
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
int psg_f32_bag_entries(long M, long bags, const long *offsets, long n_offsets, int include_last, int mean,
                        long padding, const long *tokens, const float *psw, long K, long V, long *sample,
                        long *token_out, long *source, float *weight);
int psg_f64_keyed_sq_norms(long M, long N, long K, long d, const long *sample, const long *token,
                           const long *source, const double *weight, const double *rows, long row_stride, int threads,
                           double *out);
int psg_f32_keyed_sq_norms(long M, long N, long K, long d, const long *sample, const long *token,
                           const long *source, const float *weight, const float *rows, long row_stride, int threads,
                           float *out);
int psg_f32_keyed_table_sum(long M, long N, long d, long V, long n_rows, const long *sample, const long *token,
                            const long *source, const float *weight, const float *factor, const float *rows,
                            long row_stride, float *out);
int psg_f32_gram64(long B, long T, long D, const float *x, long bs, long rs, int threads, double *out);
int psg_f64_gram64(long B, long T, long D, const double *x, long bs, long rs, int threads, double *out);
static long rnd(long n) { return n > 0 ? rand() % n : 0; }
int main(void) {
  srand(7);
  long fails = 0, runs = 0;
  for (int it = 0; it < 20000; ++it) {
    long K = 1 + rnd(4), N = rnd(6), bags = N * K, V = 1 + rnd(7), d = 1 + rnd(9);
    int flat = rnd(2), include_last = flat ? rnd(2) : 0, mean = rnd(2);
    long padding = rnd(3) == 0 ? -1 : rnd(V);
    long L = 1 + rnd(5);
    long n_off = include_last ? bags + 1 : bags;
    long *offsets = malloc(sizeof(long) * (n_off + 1));
    long M = 0;
    if (flat) {
      offsets[0] = 0;
      for (long b = 1; b < n_off; ++b) offsets[b] = offsets[b - 1] + rnd(4);
      M = (n_off ? offsets[n_off - 1] : 0) + rnd(3);
      if (rnd(10) == 0 && n_off > 1) offsets[1] = M + 5; /* invalid: past the input */
    } else {
      M = bags * L;
    }
    long *tokens = malloc(sizeof(long) * (M + 1));
    for (long m = 0; m < M; ++m) tokens[m] = rnd(10) == 0 ? V : rnd(V); /* sometimes out of range */
    float *psw = rnd(2) ? malloc(sizeof(float) * (M + 1)) : NULL;
    if (psw) for (long m = 0; m < M; ++m) psw[m] = (float)rand() / RAND_MAX;
    long *ids = malloc(sizeof(long) * (3 * M + 1));
    float *w = malloc(sizeof(float) * (M + 1));
    int st = psg_f32_bag_entries(M, flat ? 0 : bags, flat ? offsets : NULL, n_off, include_last, mean, padding, tokens,
                                 psw, K, V, ids, ids + M, ids + 2 * M, w);
    runs++;
    if (st == 0 && N > 0) {
      float *rows = malloc(sizeof(float) * (bags * d + 1));
      for (long i = 0; i < bags * d; ++i) rows[i] = rnd(50) == 0 ? INFINITY : (float)rand() / RAND_MAX - 0.5f;
      float *out = malloc(sizeof(float) * N);
      int s2 = psg_f32_keyed_sq_norms(M, N, K, d, ids, ids + M, ids + 2 * M, w, rows, d, 1, out);
      if (s2 != 0) fails++;
      float *fac = malloc(sizeof(float) * N);
      for (long n = 0; n < N; ++n) fac[n] = isfinite(out[n]) ? 0.5f : 0.0f;
      float *table = calloc(V * d, sizeof(float));
      int s3 = psg_f32_keyed_table_sum(M, N, d, V, bags, ids, ids + M, ids + 2 * M, w, fac, rows, d, table);
      if (s3 != 0) fails++;
      free(rows); free(out); free(fac); free(table);
    }
    free(offsets); free(tokens); free(psw); free(ids); free(w);
  }
  /* keyed_sq_norms refusals with random (invalid) entries, f64 */
  for (int it = 0; it < 5000; ++it) {
    long K = 1 + rnd(3), N = 1 + rnd(4), d = 1 + rnd(5), M = rnd(12);
    long *sample = malloc(sizeof(long) * (M + 1)), *token = malloc(sizeof(long) * (M + 1)), *source = malloc(sizeof(long) * (M + 1));
    double *weight = malloc(sizeof(double) * (M + 1));
    for (long m = 0; m < M; ++m) {
      sample[m] = rnd(N + 1) - (rnd(20) == 0); token[m] = rnd(6); source[m] = sample[m] * K + rnd(K + 1) - (rnd(20) == 0);
      weight[m] = rnd(4) ? (double)rand() / RAND_MAX : 0.0;
    }
    double *rows = malloc(sizeof(double) * N * K * d), *out = malloc(sizeof(double) * N);
    for (long i = 0; i < N * K * d; ++i) rows[i] = 1.0;
    psg_f64_keyed_sq_norms(M, N, K, d, sample, token, source, weight, rows, d, 2, out);
    free(sample); free(token); free(source); free(weight); free(rows); free(out);
  }
  /* gram64: every shape of up to 3 matrices, 13 rows and 1100 columns (several panels), zero rows, rows and
   * matrices spaced apart (the gaps hold NaN: a read outside a row would show), 1 and 2 threads */
  for (int it = 0; it < 400; ++it) {
    long B = 1 + rnd(3), T = 1 + rnd(13), D = rnd(4) ? 1 + rnd(40) : 500 + rnd(600);
    long rs = D + rnd(3), bs = T * rs + rnd(5);
    int dbl = rnd(2), threads = 1 + rnd(2);
    float *xf = malloc(sizeof(float) * B * bs);
    double *xd = malloc(sizeof(double) * B * bs), *out = malloc(sizeof(double) * B * T * T);
    for (long i = 0; i < B * bs; ++i) { xf[i] = NAN; xd[i] = NAN; }
    for (long b = 0; b < B; ++b)
      for (long i = 0; i < T; ++i)
        for (long k = 0, zero = rnd(3) == 0; k < D; ++k) /* a third of the rows all zero (left out) */
          xf[b * bs + i * rs + k] = (float)(xd[b * bs + i * rs + k] = zero ? 0.0 : rnd(2001) / 1000.0 - 1.0);
    int status = dbl ? psg_f64_gram64(B, T, D, xd, bs, rs, threads, out) : psg_f32_gram64(B, T, D, xf, bs, rs, threads, out);
    runs++;
    if (status != 0) fails++;
    for (long b = 0; b < B && status == 0; ++b)
      for (long i = 0; i < T; ++i)
        for (long j = 0; j < T; ++j) {
          double ref = 0, mag = 0;
          for (long k = 0; k < D; ++k) {
            const double p = (dbl ? xd[b * bs + i * rs + k] * xd[b * bs + j * rs + k]
                                  : (double)xf[b * bs + i * rs + k] * (double)xf[b * bs + j * rs + k]);
            ref += p;
            mag += fabs(p);
          }
          if (!(fabs(out[b * T * T + i * T + j] - ref) <= 1e-12 * (mag + 1))) { fails++; i = T; break; }
        }
    free(xf); free(xd); free(out);
  }
  printf("runs %ld unexpected failures %ld\n", runs, fails);
  return fails ? 1 : 0;
}
