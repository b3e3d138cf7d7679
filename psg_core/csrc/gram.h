/* Gram matrices in float64 of float32 (or float64) rows: ghost clipping's per-sample squared norms
 * sum_{i,j} (a_i . a_j)(g_i . g_j) over a sample's T rows need the inner products exactly enough
 * that rows which nearly cancel leave their true (small) norm, not float32 rounding noise (see
 * psg_core.grad_sample.ghost_norm.gram_dtype). Products of float32 numbers are exact in float64.
 *
 * torch computes these as a cast to float64 (a fresh T x D buffer per matrix) and a batched
 * float64 matrix product, which on a CPU runs at about half the float32 rate and computes both
 * triangles of the symmetric result. Here each matrix's rows are converted panel by panel (D cut
 * into chunks of PSG_GRAM_KC) into a zero-padded float64 buffer that stays in cache, and only the
 * blocks on and above the diagonal are computed: PSG_GRAM_RB x PSG_GRAM_RB dot products at a time,
 * their accumulators (PSG_GRAM_LANES-wide GCC vectors, which the compiler maps to the host's
 * widest SIMD) held in registers, then mirrored. Rows that are all zero are left out (their
 * products are 0): the padded positions of a right-padded batch get zero output gradients in
 * every layer of a causal model, so its gradients' Grams cost the real tokens' rows only. An LSTM's gate gradients at batch 8, 64 steps,
 * 1024 gates: 1.0 ms against torch's 2.2-5.5 ms (cast and product) on one core of the 2-core AMD
 * EPYC, where the float32 product takes 0.8 ms.
 *
 * Included by recurrence.c once per type with REAL and NAME(x) defined (see sequence.h). The
 * torch path in psg_core.grad_sample.ghost_norm is the fallback and the reference the tests
 * compare with. Each matrix is computed by one thread in one order: the results do not depend on
 * the thread count.
 */

#ifndef PSG_GRAM_COMMON
#define PSG_GRAM_COMMON
#define PSG_GRAM_LANES 8
typedef double psg_gram_vd __attribute__((vector_size(PSG_GRAM_LANES * 8)));
#if defined(__AVX512F__)
#define PSG_GRAM_RB 4 /* 16 accumulators and 8 operands: 24 of the 32 vector registers */
#else
#define PSG_GRAM_RB 2 /* each accumulator two AVX2 registers: 8 of them and 8 operands, of 16 */
#endif
#define PSG_GRAM_KC 512 /* doubles of each row per panel: a 64-row panel is 256 KB */

static double psg_gram_hsum(const psg_gram_vd *v) { /* (by address: a 64-byte vector by value has no stable ABI) */
  double s = 0;
  for (int i = 0; i < PSG_GRAM_LANES; ++i) s += (*v)[i];
  return s;
}

/* o[row[i]][row[j]] += panel_i . panel_j for i <= j < n (o is T x T): `panel` is (np, kc) float64,
 * rows of 64-byte alignment, kc a multiple of PSG_GRAM_LANES, rows n .. np-1 zero; row[i] is
 * panel row i's row of the matrix. */
static PSG_FUSED void psg_gram_panel(long T, long n, long np, long kc, const double *panel, const long *row,
                                     double *o) {
  for (long i0 = 0; i0 < np; i0 += PSG_GRAM_RB)
    for (long j0 = i0; j0 < np; j0 += PSG_GRAM_RB) {
      psg_gram_vd acc[PSG_GRAM_RB][PSG_GRAM_RB];
      for (int r = 0; r < PSG_GRAM_RB; ++r)
        for (int c = 0; c < PSG_GRAM_RB; ++c) acc[r][c] = (psg_gram_vd){0};
      const double *xi = panel + i0 * kc, *xj = panel + j0 * kc;
      for (long k = 0; k < kc; k += PSG_GRAM_LANES) {
        psg_gram_vd a[PSG_GRAM_RB], b[PSG_GRAM_RB];
        for (int r = 0; r < PSG_GRAM_RB; ++r) a[r] = *(const psg_gram_vd *)(xi + r * kc + k);
        for (int c = 0; c < PSG_GRAM_RB; ++c) b[c] = *(const psg_gram_vd *)(xj + c * kc + k);
        for (int r = 0; r < PSG_GRAM_RB; ++r)
          for (int c = 0; c < PSG_GRAM_RB; ++c) acc[r][c] += a[r] * b[c];
      }
      for (int r = 0; r < PSG_GRAM_RB; ++r)
        for (int c = 0; c < PSG_GRAM_RB; ++c) {
          const long i = i0 + r, j = j0 + c;
          if (i <= j && j < n) o[row[i] * T + row[j]] += psg_gram_hsum(&acc[r][c]);
        }
    }
}
#endif

/* Matrices b0 .. b1 of NAME(gram64) on the calling thread. Returns 0 or -1 (memory). */
static int NAME(gram_range)(long b0, long b1, long T, long D, const REAL *x, long bs, long rs, double *out) {
  const long Tp = (T + PSG_GRAM_RB - 1) / PSG_GRAM_RB * PSG_GRAM_RB;
  const long width = D < PSG_GRAM_KC ? (D + PSG_GRAM_LANES - 1) / PSG_GRAM_LANES * PSG_GRAM_LANES : PSG_GRAM_KC;
  double *panel = (double *)aligned_alloc(64, sizeof(double) * (size_t)(Tp * width));
  long *row = (long *)malloc(sizeof(long) * (size_t)T);
  if (panel == NULL || row == NULL) {
    free(panel);
    free(row);
    return -1;
  }
  for (long b = b0; b < b1; ++b) {
    const REAL *xb = x + b * bs;
    double *o = out + b * T * T;
    for (long i = 0; i < T * T; ++i) o[i] = 0;
    /* the rows that are not all zero (NaN and inf included): a zero row's products are 0, and
     * a padded sequence's positions get zero output gradients in every layer */
    long n = 0;
    for (long i = 0; i < T; ++i) {
      const REAL *src = xb + i * rs;
      long k = 0;
      while (k < D && src[k] == 0) ++k;
      if (k < D) row[n++] = i;
    }
    const long np = (n + PSG_GRAM_RB - 1) / PSG_GRAM_RB * PSG_GRAM_RB;
    for (long k0 = 0; k0 < D && n > 0; k0 += PSG_GRAM_KC) {
      const long kn = D - k0 < PSG_GRAM_KC ? D - k0 : PSG_GRAM_KC;
      const long kc = (kn + PSG_GRAM_LANES - 1) / PSG_GRAM_LANES * PSG_GRAM_LANES;
      for (long i = 0; i < np; ++i) {
        double *dst = panel + i * kc;
        long k = 0;
        if (i < n) {
          const REAL *src = xb + row[i] * rs + k0;
          for (; k < kn; ++k) dst[k] = (double)src[k];
        }
        for (; k < kc; ++k) dst[k] = 0;
      }
      psg_gram_panel(T, n, np, kc, panel, row, o);
    }
    for (long i = 1; i < T; ++i)
      for (long j = 0; j < i; ++j) o[i * T + j] = o[j * T + i];
  }
  free(panel);
  free(row);
  return 0;
}

/* out (B, T, T) float64, contiguous: out[b] = x_b x_b^T for B matrices x_b (T, D) of REAL rows,
 * x_b at x + b * bs, row i at x_b + i * rs, unit stride within a row; every product and sum in
 * float64. The matrices are split over up to `threads` threads. Returns 0 or -1 (memory). */
int NAME(gram64)(long B, long T, long D, const REAL *x, long bs, long rs, int threads, double *out) {
  if (threads > B) threads = (int)B;
  int failed = 0;
  if (threads <= 1) {
    failed = NAME(gram_range)(0, B, T, D, x, bs, rs, out);
  } else {
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
      const long index = PSG_THREAD_INDEX(), count = PSG_THREAD_COUNT();
      failed |= NAME(gram_range)(B * index / count, B * (index + 1) / count, T, D, x, bs, rs, out);
    }
  }
  return failed ? -1 : 0;
}
