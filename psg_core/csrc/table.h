/* Ghost clipping of a lookup table whose per-sample gradient is a sum of weighted rows: an
 * EmbeddingBag's (modes sum and mean). Token m of bag b sends weight[m] * g_b to table row
 * token[m], g_b the gradient of bag b's output; sample n owns bags n*K .. n*K+K-1 (K augmented
 * copies). In torch ops the three steps below take 9, 22 and 10 small ops (a sort, scatters,
 * index_adds: each a few microseconds of fixed cost on a CPU for a few thousand numbers); here
 * each is one call.
 *
 *   bag_entries:     each token's bag, sample, table row and weight, from the call's input,
 *                    offsets, per-sample weights, mode and padding_idx;
 *   keyed_sq_norms:  each sample's squared norm of its table gradient, from the entries and the
 *                    bags' gradients, without the (V, d) gradient: the entries of one sample
 *                    sorted by table row make each row a run, and a run sends
 *                    sum_k c_k g_{nK+k} (c_k the weights of its entries from bag k), so the
 *                    squared norm is sum_{k,l} S[k,l] <g_{nK+k}, g_{nK+l}> with S the sum of
 *                    c c^T over the runs (or, where K*K exceeds d, each run's row summed);
 *   keyed_table_sum: the clipped sum sum_n f_n grad_n: each entry's row scaled by its weight and
 *                    its sample's factor, added into its table row (a factor of 0, a dropped
 *                    sample's, skips its rows, which may hold inf).
 *
 * Included by recurrence.c once per type with REAL and NAME(x) defined (see sequence.h). The
 * torch-op path in psg_core (grad_sample/embedding.py, grad_sample/ghost_norm.py,
 * backends/ghost.py) is the fallback and the reference the tests compare with. Each sample's
 * norm is computed by one thread in one order: the results do not depend on the thread count.
 */

#ifndef PSG_TABLE_COMMON
#define PSG_TABLE_COMMON
/* an entry of one sample, ordered by table row, then by position (the order is total: the
 * result does not depend on the sort's algorithm) */
struct psg_entry {
  long token;
  long m;
};

static int psg_entry_cmp(const void *a, const void *b) {
  const struct psg_entry *x = (const struct psg_entry *)a, *y = (const struct psg_entry *)b;
  if (x->token != y->token) return (x->token > y->token) - (x->token < y->token);
  return (x->m > y->m) - (x->m < y->m);
}

static void psg_sort_entries(struct psg_entry *e, long n) {
  if (n > 24) {
    qsort(e, (size_t)n, sizeof *e, psg_entry_cmp);
    return;
  }
  for (long i = 1; i < n; ++i) { /* a bag's few tokens: insertion sort */
    struct psg_entry v = e[i];
    long j = i - 1;
    while (j >= 0 && psg_entry_cmp(&e[j], &v) > 0) {
      e[j + 1] = e[j];
      --j;
    }
    e[j + 1] = v;
  }
}
#endif

/* The entries of an EmbeddingBag call (modes sum and mean). `tokens` holds M token ids: a flat
 * input with `n_offsets` offsets (bags = n_offsets, or n_offsets - 1 with `include_last`), or
 * with `offsets` NULL a 2-D input of `bags` rows of M / bags tokens. `psw`: the per-sample
 * weights (M) or NULL; `padding` the padding row or -1; `mean`: divide by the bag's count.
 * Writes, M each: `sample` (bag / K), `token_out` (the token, 0 where it does not count),
 * `source` (its bag, 0 past include_last's last offset) and `weight` (0 for a padding token and one past
 * include_last's last offset, which torch leaves out of its bag; else its per-sample weight or 1,
 * divided for mode mean by its bag's number of counted tokens).
 * Returns 0; -1 where memory could not be had; -2 for offsets that do not rise from 0 within
 * [0, M] or a token outside [0, V) (nothing is written that the caller keeps then). */
int NAME(bag_entries)(long M, long bags, const long *offsets, long n_offsets, int include_last, int mean,
                      long padding, const long *tokens, const REAL *psw, long K, long V, long *sample,
                      long *token_out, long *source, REAL *weight) {
  if (K < 1) return -2;
  if (offsets != NULL) {
    bags = include_last ? n_offsets - 1 : n_offsets;
    if (n_offsets < 1 || offsets[0] != 0) return -2;
    for (long b = 1; b < n_offsets; ++b)
      if (offsets[b] < offsets[b - 1] || offsets[b] > M) return -2;
  } else if (bags < 1 || M % bags) {
    return -2;
  }
  if (bags < 0) return -2;
  long *sizes = NULL;
  if (mean && bags > 0) {
    sizes = (long *)calloc((size_t)bags, sizeof(long));
    if (sizes == NULL) return -1;
  }
  const long length = offsets == NULL ? M / bags : 0;
  /* the token's bag: the last b < bags with offsets[b] <= p (bag 0 for tokens before offsets[1]);
   * past include_last's last offset, none */
  const long end = (offsets != NULL && include_last) ? offsets[bags] : M;
  long b = bags > 0 ? 0 : -1;
  for (long p = 0; p < M; ++p) {
    const long t = tokens[p];
    if (t < 0 || t >= V) {
      free(sizes);
      return -2;
    }
    if (offsets != NULL) {
      while (b >= 0 && b + 1 < bags && offsets[b + 1] <= p) ++b;
    } else {
      b = p / length;
    }
    const long bag = p < end ? b : -1;
    const int counted = bag >= 0 && t != padding;
    source[p] = bag >= 0 ? bag : 0;
    token_out[p] = counted ? t : 0;
    weight[p] = counted ? (psw != NULL ? psw[p] : (REAL)1) : (REAL)0;
    if (counted && sizes != NULL) ++sizes[bag];
  }
  for (long p = 0; p < M; ++p) {
    if (sizes != NULL && weight[p] != 0) weight[p] /= (REAL)sizes[source[p]];
    sample[p] = source[p] / K;
  }
  free(sizes);
  return 0;
}

/* Sample n's entries (those of weight != 0), ordered by position: order[start[n] .. start[n+1]).
 * Returns 0, -1 (memory) or -2 (an entry's sample outside [0, N), or its source not one of its
 * sample's K rows). */
static int NAME(by_sample)(long M, long N, long K, const long *sample, const long *source, const REAL *weight,
                           long **start_out, long **order_out) {
  long *start = (long *)calloc((size_t)N + 1, sizeof(long));
  long *order = (long *)malloc(sizeof(long) * (size_t)(M > 0 ? M : 1));
  if (start == NULL || order == NULL) {
    free(start);
    free(order);
    return -1;
  }
  for (long m = 0; m < M; ++m) {
    const long n = sample[m];
    if (n < 0 || n >= N || source[m] < n * K || source[m] >= (n + 1) * K) {
      free(start);
      free(order);
      return -2;
    }
    if (weight[m] != 0) ++start[n + 1];
  }
  for (long n = 0; n < N; ++n) start[n + 1] += start[n];
  long *next = (long *)malloc(sizeof(long) * (size_t)(N > 0 ? N : 1));
  if (next == NULL) {
    free(start);
    free(order);
    return -1;
  }
  memcpy(next, start, sizeof(long) * (size_t)N);
  for (long m = 0; m < M; ++m)
    if (weight[m] != 0) order[next[sample[m]]++] = m;
  free(next);
  *start_out = start;
  *order_out = order;
  return 0;
}

static double NAME(dot)(const REAL *x, const REAL *y, long d) {
  double s = 0;
  for (long j = 0; j < d; ++j) s += (double)x[j] * (double)y[j];
  return s;
}

/* Per-thread scratch of keyed_sq_norms: the sorted entries of one sample, the run coefficients
 * c (K), their outer products S (K*K), the rows touched by the current run and the run that last
 * touched each row (K each), and a run's summed row v (d). */
struct NAME(scratch) {
  struct psg_entry *e;
  double *c, *S, *v;
  long *touched, *seen, run;
};

/* One sample's squared norm from its entries `e` (sorted by table row): the run coefficients'
 * outer products S against the Gram of its K rows, or each run's summed row where K*K > d. */
static double NAME(sample_sq_norm)(long n, long K, long d, long count, const long *source, const REAL *weight,
                                   const REAL *rows, long row_stride, struct NAME(scratch) *w) {
  const struct psg_entry *e = w->e;
  const int by_gram = K * K <= d;
  double total = 0;
  if (by_gram)
    for (long i = 0; i < K * K; ++i) w->S[i] = 0;
  for (long i = 0; i < count;) {
    long j = i;
    if (by_gram) {
      long used = 0;
      const long run = ++w->run;
      for (; j < count && e[j].token == e[i].token; ++j) {
        const long m = e[j].m, k = source[m] - n * K;
        if (w->seen[k] != run) {
          w->seen[k] = run;
          w->touched[used++] = k;
          w->c[k] = 0;
        }
        w->c[k] += (double)weight[m];
      }
      for (long a = 0; a < used; ++a)
        for (long b = 0; b < used; ++b)
          w->S[w->touched[a] * K + w->touched[b]] += w->c[w->touched[a]] * w->c[w->touched[b]];
    } else {
      for (long q = 0; q < d; ++q) w->v[q] = 0;
      for (; j < count && e[j].token == e[i].token; ++j) {
        const long m = e[j].m;
        const REAL *row = rows + source[m] * row_stride;
        const double c = (double)weight[m];
        for (long q = 0; q < d; ++q) w->v[q] += c * (double)row[q];
      }
      double s = 0;
      for (long q = 0; q < d; ++q) s += w->v[q] * w->v[q];
      total += s;
    }
    i = j;
  }
  if (by_gram) {
    for (long k = 0; k < K; ++k)
      for (long l = k; l < K; ++l) {
        const double s = l == k ? w->S[k * K + k] : w->S[k * K + l] + w->S[l * K + k];
        if (s != 0) /* no term where no run sends both rows (their product may be inf * 0) */
          total += s * NAME(dot)(rows + (n * K + k) * row_stride, rows + (n * K + l) * row_stride, d);
      }
    if (total < 0) total = 0; /* rounding; NaN stays NaN */
  }
  return total;
}

/* keyed_sq_norms for samples n0 .. n1 on the calling thread. Returns 0 or -1 (memory). */
static int NAME(sq_norm_range)(long n0, long n1, long K, long d, long most, const long *start, const long *order,
                               const long *token, const long *source, const REAL *weight, const REAL *rows,
                               long row_stride, REAL *out) {
  struct NAME(scratch) w;
  w.e = (struct psg_entry *)malloc(sizeof(struct psg_entry) * (size_t)(most > 0 ? most : 1));
  w.c = (double *)calloc((size_t)(K + K * K + d + 1), sizeof(double));
  w.touched = (long *)calloc((size_t)(2 * K), sizeof(long));
  int status = -1;
  if (w.e != NULL && w.c != NULL && w.touched != NULL) {
    w.S = w.c + K;
    w.v = w.S + K * K;
    w.seen = w.touched + K;
    w.run = 0;
    for (long n = n0; n < n1; ++n) {
      const long count = start[n + 1] - start[n];
      for (long i = 0; i < count; ++i) {
        const long m = order[start[n] + i];
        w.e[i].token = token[m];
        w.e[i].m = m;
      }
      psg_sort_entries(w.e, count);
      out[n] = (REAL)NAME(sample_sq_norm)(n, K, d, count, source, weight, rows, row_stride, &w);
    }
    status = 0;
  }
  free(w.e);
  free(w.c);
  free(w.touched);
  return status;
}

/* out[n] (N) = sum over table rows v of || sum_{m: sample[m] = n, token[m] = v} weight[m] rows[source[m]] ||^2,
 * rows (N*K, d) with row stride `row_stride`, source[m] one of sample[m]'s K rows. Entries of
 * weight 0 add nothing, whatever their row holds. The samples are split over up to `threads`
 * threads. Returns 0, -1 (memory) or -2 (an entry outside its sample's rows). */
int NAME(keyed_sq_norms)(long M, long N, long K, long d, const long *sample, const long *token,
                         const long *source, const REAL *weight, const REAL *rows, long row_stride, int threads,
                         REAL *out) {
  long *start = NULL, *order = NULL;
  const int status = NAME(by_sample)(M, N, K, sample, source, weight, &start, &order);
  if (status != 0) return status;
  long most = 0;
  for (long n = 0; n < N; ++n)
    if (start[n + 1] - start[n] > most) most = start[n + 1] - start[n];
  if (threads > N) threads = (int)N;
  int failed = 0;
  if (threads <= 1) {
    failed = NAME(sq_norm_range)(0, N, K, d, most, start, order, token, source, weight, rows, row_stride, out);
  } else {
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
      const long index = PSG_THREAD_INDEX(), count = PSG_THREAD_COUNT();
      failed |= NAME(sq_norm_range)(N * index / count, N * (index + 1) / count, K, d, most, start, order, token,
                                    source, weight, rows, row_stride, out);
    }
  }
  free(start);
  free(order);
  return failed ? -1 : 0;
}

/* out (V, d), contiguous, zeroed by the caller: out[token[m]] += weight[m] * factor[sample[m]] * rows[source[m]]
 * for every entry in order, skipping those whose scale is 0 (a dropped sample's factor: its rows
 * may hold inf). Returns 0, or -2 (a token outside [0, V), a source outside [0, n_rows) or a sample
 * outside [0, N): nothing written). */
int NAME(keyed_table_sum)(long M, long N, long d, long V, long n_rows, const long *sample, const long *token,
                          const long *source, const REAL *weight, const REAL *factor, const REAL *rows,
                          long row_stride, REAL *out) {
  for (long m = 0; m < M; ++m)
    if (token[m] < 0 || token[m] >= V || source[m] < 0 || source[m] >= n_rows || sample[m] < 0 || sample[m] >= N)
      return -2;
  for (long m = 0; m < M; ++m) {
    const REAL s = weight[m] * factor[sample[m]];
    if (s == 0) continue;
    const REAL *row = rows + source[m] * row_stride;
    REAL *target = out + token[m] * d;
    PSG_SIMD for (long q = 0; q < d; ++q) target[q] += s * row[q];
  }
  return 0;
}
