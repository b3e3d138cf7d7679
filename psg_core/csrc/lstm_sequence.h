/* One LSTM direction's time loop, forward and backward, for one element type.
 *
 * Included by recurrence.c once per type with these defined:
 *   REAL      the element type (float or double)
 *   VEC       a GCC vector of REAL, VEC_BYTES wide; VECU the same with REAL's alignment
 *   LANES     REAL elements per VEC
 *   EXP, TANH the scalar functions (vectorised through libmvec where the compiler can)
 *   NAME(x)   the exported name of x for this type
 *
 * Work split: the H hidden units are cut into blocks of LANES units, and each thread owns a run of
 * blocks for the whole call. A unit's four gates (columns j, H+j, 2H+j, 3H+j of the product)
 * depend only on the previous state and the unit's own columns of W, so each step a thread
 * computes its units' gates, their new c and h, and waits at a barrier for the others' h before the
 * next step's product needs all of it. The backward is split the same way over the columns of
 * dh = dgates @ W_hh, which are the units whose gate gradients the thread then computes. Every
 * output element is computed by one thread in a fixed order: the results do not depend on the
 * number of threads.
 *
 * The product's rows are processed ROWS at a time from a zero-padded copy of the previous state (or
 * gate gradient), so the microkernel's loops have constant bounds and its accumulators stay in
 * registers: two LANES-wide column blocks times ROWS rows.
 */

/* acc{0,1}[r] += sum_k x[r][k] * w{0,1}[k * ws]: x is ROWS rows of K (row stride xs). */
#define MICROKERNEL(K, x, xs, w0, w1, ws, acc0, acc1)                                  \
  do {                                                                                  \
    for (long k_ = 0; k_ < (K); ++k_) {                                                 \
      VEC a_ = *(const VECU *)((w0) + k_ * (ws));                                       \
      VEC b_ = *(const VECU *)((w1) + k_ * (ws));                                       \
      _Pragma("GCC unroll 8") for (int r_ = 0; r_ < ROWS; ++r_) {                       \
        REAL s_ = (x)[r_ * (xs) + k_];                                                  \
        (acc0)[r_] += s_ * a_;                                                          \
        (acc1)[r_] += s_ * b_;                                                          \
      }                                                                                 \
    }                                                                                   \
  } while (0)

struct NAME(forward_job) {
  long B, H, T, Bp;
  int reverse;
  const REAL *gx; long gx_b, gx_t;     /* (B, T, 4H): input gates with the input bias */
  const REAL *wt;                      /* (H, 4H): W_hh transposed, contiguous */
  const REAL *bias;                    /* (4H) hidden bias, or NULL */
  REAL *hg; long hg_b, hg_t;           /* (B, T, 4H): out, W_hh h_prev + b_hh */
  REAL *act;                           /* (T, B, 4H) contiguous: sigmoid i, f, tanh g, sigmoid o */
  REAL *cand, *tanh_c;                 /* (T, B, H) contiguous */
  REAL *hs, *cs;                       /* (T+1, B, H) contiguous: slot 0 (T when reverse) holds h0, c0 */
  REAL *scratch;                       /* 2 x (Bp, H): padded copies of the state, double-buffered */
};

static void NAME(forward_units)(const struct NAME(forward_job) *job, long u0, long u1, int t, int read,
                                int write, const REAL *h_in, REAL *h_out) {
  const long B = job->B, H = job->H, G = 4 * H;
  const REAL one = (REAL)1;
  REAL pre[4][ROWS][LANES];
  for (long r0 = 0; r0 < job->Bp; r0 += ROWS) {
    for (long u = u0; u < u1; u += LANES) {
      const long width = (u1 - u < LANES) ? u1 - u : LANES;
      if (width == LANES) {
        for (int q = 0; q < 4; q += 2) {
          VEC acc0[ROWS], acc1[ROWS];
          VEC b0 = {0}, b1 = {0};
          if (job->bias != NULL) {
            b0 = *(const VECU *)(job->bias + q * H + u);
            b1 = *(const VECU *)(job->bias + (q + 1) * H + u);
          }
          for (int r = 0; r < ROWS; ++r) { acc0[r] = b0; acc1[r] = b1; }
          MICROKERNEL(H, h_in + r0 * H, H, job->wt + q * H + u, job->wt + (q + 1) * H + u, G, acc0, acc1);
          for (int r = 0; r < ROWS; ++r) {
            *(VECU *)pre[q][r] = acc0[r];
            *(VECU *)pre[q + 1][r] = acc1[r];
          }
        }
      } else {
        for (int q = 0; q < 4; ++q)
          for (int r = 0; r < ROWS; ++r)
            for (long j = 0; j < width; ++j) {
              REAL s = job->bias != NULL ? job->bias[q * H + u + j] : (REAL)0;
              const REAL *x = h_in + (r0 + r) * H;
              const REAL *w = job->wt + q * H + u + j;
              for (long k = 0; k < H; ++k) s += x[k] * w[k * G];
              pre[q][r][j] = s;
            }
      }
      /* the cell, for the block's units and the group's real rows */
      for (int r = 0; r < ROWS && r0 + r < B; ++r) {
        const long b = r0 + r;
        const REAL *x = job->gx + b * job->gx_b + t * job->gx_t;
        REAL *hg = job->hg + b * job->hg_b + t * job->hg_t;
        REAL *a = job->act + (t * B + b) * G;
        REAL *cd = job->cand + (t * B + b) * H, *tc = job->tanh_c + (t * B + b) * H;
        const REAL *cp = job->cs + (read * B + b) * H;
        REAL *cn = job->cs + (write * B + b) * H, *hn = job->hs + (write * B + b) * H;
        REAL *ho = h_out + b * H;
        PSG_SIMD for (long j = 0; j < width; ++j) {
          const long n = u + j;
          REAL pi = pre[0][r][j], pf = pre[1][r][j], pg = pre[2][r][j], po = pre[3][r][j];
          hg[n] = pi;
          hg[H + n] = pf;
          hg[2 * H + n] = pg;
          hg[3 * H + n] = po;
          REAL i = one / (one + EXP(-(pi + x[n])));
          REAL f = one / (one + EXP(-(pf + x[H + n])));
          REAL g = TANH(pg + x[2 * H + n]);
          REAL o = one / (one + EXP(-(po + x[3 * H + n])));
          REAL c = f * cp[n] + i * g;
          REAL th = TANH(c);
          a[n] = i;
          a[H + n] = f;
          a[2 * H + n] = g;
          a[3 * H + n] = o;
          cd[n] = g;
          cn[n] = c;
          tc[n] = th;
          hn[n] = o * th;
          ho[n] = o * th;
        }
      }
    }
  }
}

static void NAME(forward_thread)(const struct NAME(forward_job) *job, int index, int threads) {
  const long H = job->H, T = job->T;
  const long blocks = (H + LANES - 1) / LANES;
  const long u0 = (blocks * index / threads) * LANES;
  long u1 = (blocks * (index + 1) / threads) * LANES;
  if (u1 > H) u1 = H;
  for (long p = 0; p < T; ++p) {
    const int t = (int)(job->reverse ? T - 1 - p : p);
    const int read = job->reverse ? t + 1 : t, write = job->reverse ? t : t + 1;
    const REAL *h_in = job->scratch + (p % 2) * job->Bp * H;
    REAL *h_out = job->scratch + ((p + 1) % 2) * job->Bp * H;
    if (u0 < u1) NAME(forward_units)(job, u0, u1, t, read, write, h_in, h_out);
#pragma omp barrier
  }
}

/* The forward time loop on up to `threads` threads. Returns 0, or -1 when memory could not be had
 * (nothing was computed then, and the caller falls back). */
int NAME(lstm_forward_sequence)(long B, long H, long T, int reverse, int threads,
                                const REAL *gx, long gx_b, long gx_t, const REAL *wt, const REAL *bias,
                                REAL *hg, long hg_b, long hg_t, REAL *act, REAL *cand, REAL *tanh_c,
                                REAL *hs, REAL *cs) {
  struct NAME(forward_job) job;
  const long Bp = (B + ROWS - 1) / ROWS * ROWS;
  const long blocks = (H + LANES - 1) / LANES;
  if (threads > blocks) threads = (int)blocks;
  if (threads < 1) threads = 1;
  REAL *scratch = (REAL *)calloc((size_t)(2 * Bp * H), sizeof(REAL));
  if (scratch == NULL) return -1;
  const long first = reverse ? T : 0;
  memcpy(scratch, hs + first * B * H, (size_t)(B * H) * sizeof(REAL));
  job = (struct NAME(forward_job)){B, H, T, Bp, reverse, gx, gx_b, gx_t, wt, bias, hg, hg_b, hg_t,
                                   act, cand, tanh_c, hs, cs, scratch};
#pragma omp parallel num_threads(threads)
  NAME(forward_thread)(&job, PSG_THREAD_INDEX(), PSG_THREAD_COUNT());
  free(scratch);
  return 0;
}

struct NAME(backward_job) {
  long B, H, T, Bp;
  int reverse;
  const REAL *w;                       /* (4H, H): W_hh, contiguous */
  const REAL *act, *cand, *c_prev, *tanh_c; long s_t, s_b, a_t, a_b;  /* (T, B, .) views */
  const REAL *dout; long do_b, do_t;   /* (B, T, H): the outputs' gradients */
  REAL *dh, *dc;                       /* (B, H) contiguous: in, the final state's gradients; out, h0's, c0's */
  REAL *dg; long dg_b, dg_t;           /* (B, T, 4H): out, the gates' gradients */
  REAL *scratch;                       /* 2 x (Bp, 4H): padded copies of a step's gate gradients */
  REAL *product; long product_stride;  /* per thread: its columns of one row group's product */
};

/* dh[b][k] for k in [k0, k1): (add ? dh_add[b][k] : 0) + sum_n g[b][n] W[n][k], the rows of g padded */
static void NAME(backward_product)(const struct NAME(backward_job) *job, long k0, long k1, const REAL *g,
                                   REAL out[][ROWS][LANES], long r0) {
  const long H = job->H, G = 4 * H;
  for (long k = k0; k < k1; k += 2 * LANES) {
    const long width = (k1 - k < 2 * LANES) ? k1 - k : 2 * LANES;
    const long block = (k - k0) / LANES;
    if (width == 2 * LANES) {
      VEC acc0[ROWS], acc1[ROWS];
      for (int r = 0; r < ROWS; ++r) { acc0[r] = (VEC){0}; acc1[r] = (VEC){0}; }
      MICROKERNEL(G, g + r0 * G, G, job->w + k, job->w + k + LANES, H, acc0, acc1);
      for (int r = 0; r < ROWS; ++r) {
        *(VECU *)out[block][r] = acc0[r];
        *(VECU *)out[block + 1][r] = acc1[r];
      }
    } else {
      for (int r = 0; r < ROWS; ++r)
        for (long j = 0; j < width; ++j) {
          REAL s = 0;
          const REAL *x = g + (r0 + r) * G;
          const REAL *w = job->w + k + j;
          for (long n = 0; n < G; ++n) s += x[n] * w[n * H];
          out[block + j / LANES][r][j % LANES] = s;
        }
    }
  }
}

static void NAME(backward_thread)(const struct NAME(backward_job) *job, int index, int threads) {
  const long B = job->B, H = job->H, G = 4 * H, T = job->T;
  const long blocks = (H + LANES - 1) / LANES;
  const long u0 = (blocks * index / threads) * LANES;
  long u1 = (blocks * (index + 1) / threads) * LANES;
  if (u1 > H) u1 = H;
  const long own = (u1 > u0) ? (u1 - u0 + LANES - 1) / LANES : 0;
  /* the product's result for the thread's columns and one row group: blocks x ROWS x LANES */
  REAL(*prod)[ROWS][LANES] = (REAL(*)[ROWS][LANES])job->product + index * job->product_stride;
  for (long p = 0; p <= T; ++p) {
    /* steps in backward order; p == T computes h0's gradient from the first step's gates */
    const int t = (int)(job->reverse ? p : T - 1 - p);
    const REAL *g_next = job->scratch + (p % 2) * job->Bp * G;   /* the later step's gate gradients */
    REAL *g_out = job->scratch + ((p + 1) % 2) * job->Bp * G;
    if (own) {
      for (long r0 = 0; r0 < job->Bp; r0 += ROWS) {
        if (p > 0) NAME(backward_product)(job, u0, u1, g_next, prod, r0);
        for (int r = 0; r < ROWS && r0 + r < B; ++r) {
          const long b = r0 + r;
          REAL *dhb = job->dh + b * H, *dcb = job->dc + b * H;
          if (p == T) {  /* h0's gradient: the product alone */
            for (long j = u0; j < u1; ++j) dhb[j] = prod[(j - u0) / LANES][r][(j - u0) % LANES];
            continue;
          }
          const REAL *dy = job->dout + b * job->do_b + t * job->do_t;
          const REAL *a = job->act + t * job->a_t + b * job->a_b;
          const REAL *cd = job->cand + t * job->s_t + b * job->s_b;
          const REAL *cp = job->c_prev + t * job->s_t + b * job->s_b;
          const REAL *tc = job->tanh_c + t * job->s_t + b * job->s_b;
          REAL *d = job->dg + b * job->dg_b + t * job->dg_t;
          REAL *e = g_out + b * G;
          for (long ub = u0; ub < u1; ub += LANES) {
            const long width = (u1 - ub < LANES) ? u1 - ub : LANES;
            const REAL *pr = prod[(ub - u0) / LANES][r];
            PSG_SIMD for (long jj = 0; jj < width; ++jj) {
              const long j = ub + jj;
              /* the new h's total gradient: its output's, the later steps' (p > 0) or the final
                 state's (p == 0, held in dh) */
              REAL dhv = dy[j] + (p > 0 ? pr[jj] : dhb[j]);
              REAL i = a[j], f = a[H + j], g = cd[j], o = a[3 * H + j], th = tc[j];
              REAL dcn = dcb[j] + dhv * (o - o * th * th);
              REAL di = dcn * g * (i - i * i);
              REAL df = dcn * cp[j] * (f - f * f);
              REAL dgg = dcn * (i - i * g * g);
              REAL dO = dhv * th * (o - o * o);
              d[j] = di; d[H + j] = df; d[2 * H + j] = dgg; d[3 * H + j] = dO;
              e[j] = di; e[H + j] = df; e[2 * H + j] = dgg; e[3 * H + j] = dO;
              dcb[j] = dcn * f;
            }
          }
        }
      }
    }
    if (p < T) {
#pragma omp barrier
    }
  }
}

/* The backward time loop on up to `threads` threads: dgates (B, T, 4H) from the outputs'
 * gradients, and in place the final state's gradients (dh, dc: (B, H) contiguous) become h0's and
 * c0's. Returns 0, or -1 when memory could not be had (nothing computed: the caller falls back). */
int NAME(lstm_backward_sequence)(long B, long H, long T, int reverse, int threads, const REAL *w,
                                 const REAL *act, long a_t, long a_b, const REAL *cand, const REAL *c_prev,
                                 const REAL *tanh_c, long s_t, long s_b, const REAL *dout, long do_b,
                                 long do_t, REAL *dh, REAL *dc, REAL *dg, long dg_b, long dg_t) {
  struct NAME(backward_job) job;
  const long Bp = (B + ROWS - 1) / ROWS * ROWS;
  const long blocks = (H + LANES - 1) / LANES;
  if (threads > blocks) threads = (int)blocks;
  if (threads < 1) threads = 1;
  REAL *scratch = (REAL *)calloc((size_t)(2 * Bp * 4 * H), sizeof(REAL));
  /* a thread owns at most all the blocks (OpenMP may grant fewer threads than asked for); one
     spare for the product's last pair of blocks */
  const long product_stride = blocks + 1;
  REAL *product = (REAL *)malloc(sizeof(REAL) * ROWS * LANES * product_stride * threads);
  if (scratch == NULL || product == NULL) {
    free(scratch);
    free(product);
    return -1;
  }
  job = (struct NAME(backward_job)){B, H, T, Bp, reverse, w, act, cand, c_prev, tanh_c, s_t, s_b, a_t, a_b,
                                    dout, do_b, do_t, dh, dc, dg, dg_b, dg_t, scratch, product, product_stride};
#pragma omp parallel num_threads(threads)
  {
    /* a thread beyond the count asked for (never, by OpenMP's rules) would find no product buffer */
    int index = PSG_THREAD_INDEX(), count = PSG_THREAD_COUNT();
    if (count <= threads) NAME(backward_thread)(&job, index, count);
  }
  free(scratch);
  free(product);
  return 0;
}

#undef MICROKERNEL
