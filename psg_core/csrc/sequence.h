/* One recurrent direction's time loop, forward and backward, for one element type: LSTM, GRU and
 * Elman RNN (tanh or relu) cells, with torch's gate order and equations.
 *
 * Included by recurrence.c once per type with these defined:
 *   REAL      the element type (float or double)
 *   VEC       a GCC vector of REAL, VEC_BYTES wide; VECU the same with REAL's alignment
 *   LANES     REAL elements per VEC
 *   EXP, TANH the scalar functions (vectorised through libmvec where the compiler can)
 *   NAME(x)   the exported name of x for this type
 *
 * Work split: the H hidden units are cut into blocks of LANES units, and each thread owns a run of
 * blocks for the whole call. A unit's G gates (columns j, H+j, ..., (G-1)H+j of the product)
 * depend only on the previous state and the unit's own columns of W_hh, so each step a thread
 * computes its units' gates and new state, then waits at a barrier for the others' before the
 * next step's product reads all of it. The backward is split the same way over the columns of
 * dh = d_hidden @ W_hh, which are the units whose gate gradients the thread computes next. Every
 * output element is computed by one thread in one order: the results do not depend on the number
 * of threads.
 *
 * The products read ROWS rows at a time from a zero-padded copy of the previous state (or of the
 * later step's hidden-gate gradients), kept k-major per group of ROWS rows, so the microkernel's
 * loops have constant bounds and offsets and its accumulators stay in registers: two LANES-wide
 * column blocks times ROWS rows.
 */

/* acc{0,1}[r] += sum_k x[k][r] * w{0,1}[k * ws]: x is a row group's k-major (K, ROWS) tile (the
 * rows' offsets are constants, not eight pointers the loop reloads from the stack each k). */
#define MICROKERNEL(K, x, w0, w1, ws, acc0, acc1)                                      \
  do {                                                                                  \
    for (long k_ = 0; k_ < (K); ++k_) {                                                 \
      VEC a_ = *(const VECU *)((w0) + k_ * (ws));                                       \
      VEC b_ = *(const VECU *)((w1) + k_ * (ws));                                       \
      _Pragma("GCC unroll 8") for (int r_ = 0; r_ < ROWS; ++r_) {                       \
        REAL s_ = (x)[k_ * ROWS + r_];                                                  \
        (acc0)[r_] += s_ * a_;                                                          \
        (acc1)[r_] += s_ * b_;                                                          \
      }                                                                                 \
    }                                                                                   \
  } while (0)

/* The same for one column block (an odd last gate: the GRU's third, the Elman cell's only one). */
#define MICROKERNEL1(K, x, w0, ws, acc0)                                               \
  do {                                                                                  \
    for (long k_ = 0; k_ < (K); ++k_) {                                                 \
      VEC a_ = *(const VECU *)((w0) + k_ * (ws));                                       \
      _Pragma("GCC unroll 8") for (int r_ = 0; r_ < ROWS; ++r_)                         \
        (acc0)[r_] += (x)[k_ * ROWS + r_] * a_;                                         \
    }                                                                                   \
  } while (0)

/* One job: a direction's buffers, shared by the forward and backward loops (each reads its own). */
struct NAME(job) {
  int cell;                            /* PSG_LSTM, PSG_GRU, PSG_RNN_TANH, PSG_RNN_RELU */
  long B, H, T, Bp, G;                 /* batch, hidden, steps, padded batch, gates */
  int reverse;
  /* forward */
  const REAL *gx; long gx_b, gx_t;     /* (B, T, G*H): input gates, input bias included */
  const REAL *wt;                      /* W_hh packed by NAME(pack_hidden): per block of LANES units,
                                          (H, G, LANES) contiguous */
  const REAL *bias;                    /* (G*H) hidden bias, or NULL */
  REAL *hg; long hg_b, hg_t;           /* (B, T, G*H): out, W_hh h_prev + b_hh */
  REAL *act; long act_t, act_b;        /* (T, B, .): LSTM sigmoid i, f, tanh g, sigmoid o; GRU sigmoid r, z */
  REAL *cand; long cand_t, cand_b;     /* (T, B, H): LSTM tanh g; GRU n */
  REAL *tanh_c; long tc_t, tc_b;       /* (T, B, H): LSTM tanh c; backward, GRU: h_n = W_hn h_prev + b_hn */
  REAL *hs; long hs_t, hs_b;           /* forward: (T+1, B, H), the states h, slot 0 (T when reverse) the
                                          initial one; backward: (T, B, H), the GRU's h before step t,
                                          the RNN's h after it */
  REAL *cs; long cs_t, cs_b;           /* forward: (T+1, B, H), the LSTM's c, likewise; backward: (T, B, H),
                                          c before step t */
  /* backward */
  const REAL *w;                       /* (G*H, H): W_hh, contiguous */
  const REAL *dout; long do_b, do_t;   /* (B, T, H): the outputs' gradients */
  REAL *dh, *dc;                       /* (B, H) contiguous: in, the final state's gradients; out, the initial one's */
  REAL *din; long din_b, din_t;        /* (B, T, G*H): out, the input gates' gradients */
  REAL *dhid; long dhid_b, dhid_t;     /* (B, T, G*H): out, the hidden gates' gradients (may be din) */
  /* scratch */
  REAL *scratch;                       /* 2 x (Bp, K): padded copies of a step's product input, in
                                          k-major (K, ROWS) tiles per row group */
  REAL *product; long product_stride;  /* per thread: its columns of one row group's product */
};

static void NAME(units)(long H, int index, int threads, long *u0, long *u1) {
  const long blocks = (H + LANES - 1) / LANES;
  *u0 = (blocks * index / threads) * LANES;
  *u1 = (blocks * (index + 1) / threads) * LANES;
  if (*u1 > H) *u1 = H;
  if (*u0 > H) *u0 = H;
}

#ifndef PSG_TILE_ROW
#define PSG_TILE_ROW
/* Where row b of a padded (Bp, K) matrix kept in k-major (K, ROWS) tiles per row group starts: its
 * element k is at this offset + k * ROWS. */
static inline long psg_tile_row(long b, long K) { return (b / ROWS) * K * ROWS + b % ROWS; }
#endif

static inline REAL NAME(sigmoid)(REAL x) { return (REAL)1 / ((REAL)1 + EXP(-x)); }

/* W_hh (G*H, H) laid out for the forward products: per block of LANES units (the last zero-padded),
 * an (H, G, LANES) slab, so that a product over the H rows of k reads its block's slab front to
 * back (with W_hh transposed, each k was a line of its own G*H*sizeof(REAL) bytes away from the
 * last: the LSTM's (256, 1024) step ran at half the speed). `packed` holds
 * ceil(H / LANES) * H * G * LANES elements. */
void NAME(pack_hidden)(long G, long H, const REAL *w, REAL *packed) {
  const long blocks = (H + LANES - 1) / LANES, slab = H * G * LANES;
  REAL tile[LANES][LANES];
  for (long ub = 0; ub < blocks; ++ub)
    for (long q = 0; q < G; ++q)
      for (long k0 = 0; k0 < H; k0 += LANES) { /* a LANES x LANES tile: rows read, rows written */
        const long nk = (H - k0 < LANES) ? H - k0 : LANES;
        for (long j = 0; j < LANES; ++j) {
          const long unit = ub * LANES + j;
          for (long k = 0; k < nk; ++k) tile[k][j] = unit < H ? w[(q * H + unit) * H + k0 + k] : (REAL)0;
        }
        for (long k = 0; k < nk; ++k) {
          REAL *out = packed + ub * slab + (k0 + k) * G * LANES + q * LANES;
          for (long j = 0; j < LANES; ++j) out[j] = tile[k][j];
        }
      }
}

/* pre[q][r][j] = bias[q H + u + j] + sum_k x[k][r] W_hh[q H + u + j][k] for the G gates q, the
 * ROWS rows r of x (a row group's k-major (H, ROWS) tile of the padded state) and the `width`
 * units from u (a multiple of LANES). */
PSG_FUSED static void NAME(gates_product)(const struct NAME(job) *job, const REAL *x, long u, long width,
                                REAL pre[][ROWS][LANES]) {
  const long H = job->H, GL = job->G * LANES;
  const REAL *slab = job->wt + (u / LANES) * H * GL; /* the block's (H, G, LANES) */
  if (width == LANES) {
    long q = 0;
    for (; q + 1 < job->G; q += 2) { /* the gates two at a time */
      VEC acc0[ROWS], acc1[ROWS];
      VEC b0 = {0}, b1 = {0};
      if (job->bias != NULL) {
        b0 = *(const VECU *)(job->bias + q * H + u);
        b1 = *(const VECU *)(job->bias + (q + 1) * H + u);
      }
      for (int r = 0; r < ROWS; ++r) { acc0[r] = b0; acc1[r] = b1; }
      MICROKERNEL(H, x, slab + q * LANES, slab + (q + 1) * LANES, GL, acc0, acc1);
      for (int r = 0; r < ROWS; ++r) {
        *(VECU *)pre[q][r] = acc0[r];
        *(VECU *)pre[q + 1][r] = acc1[r];
      }
    }
    if (q < job->G) { /* an odd last gate alone (it was computed twice, kept once) */
      VEC acc0[ROWS];
      VEC b0 = {0};
      if (job->bias != NULL) b0 = *(const VECU *)(job->bias + q * H + u);
      for (int r = 0; r < ROWS; ++r) acc0[r] = b0;
      MICROKERNEL1(H, x, slab + q * LANES, GL, acc0);
      for (int r = 0; r < ROWS; ++r) *(VECU *)pre[q][r] = acc0[r];
    }
    return;
  }
  for (long q = 0; q < job->G; ++q)
    for (int r = 0; r < ROWS; ++r)
      for (long j = 0; j < width; ++j) {
        REAL s = job->bias != NULL ? job->bias[q * H + u + j] : (REAL)0;
        const REAL *w = slab + q * LANES + j;
        for (long k = 0; k < H; ++k) s = FMA(x[k * ROWS + r], w[k * GL], s);
        pre[q][r][j] = s;
      }
}

/* The cells' forward, for rows r0.. of one row group and the units [u, u + width). The LSTM's
 * and GRU's nonlinearities run pass by pass over the tile (every row's gate i, then f, ...): each
 * loop calls one vector function with little else live, where one loop calling five of them kept
 * spilling its values around the calls (B 8, T 64, H 256, one AMD EPYC core: the LSTM forward loop
 * 5.38 -> 4.21 ms, the GRU 4.10 -> 3.85). */
static void NAME(cell_forward)(const struct NAME(job) *job, REAL pre[][ROWS][LANES], long r0, long u,
                               long width, int t, int read, int write, REAL *h_out) {
  const long B = job->B, H = job->H;
  const int rows = (B - r0 < ROWS) ? (int)(B - r0) : ROWS;
  REAL z[4][ROWS][LANES]; /* the gates' pre-activations (input part added), then activations */
  for (int r = 0; r < rows; ++r) {
    const long b = r0 + r;
    const REAL *x = job->gx + b * job->gx_b + t * job->gx_t + u;
    REAL *hg = job->hg + b * job->hg_b + t * job->hg_t + u;
    for (long q = 0; q < job->G; ++q) {
      PSG_SIMD for (long j = 0; j < width; ++j) hg[q * H + j] = pre[q][r][j];
    }
    if (job->cell == PSG_LSTM) {
      for (long q = 0; q < 4; ++q) {
        PSG_SIMD for (long j = 0; j < width; ++j) z[q][r][j] = pre[q][r][j] + x[q * H + j];
      }
    } else if (job->cell == PSG_GRU) {
      for (long q = 0; q < 2; ++q) {
        PSG_SIMD for (long j = 0; j < width; ++j) z[q][r][j] = pre[q][r][j] + x[q * H + j];
      }
    }
  }
  if (job->cell == PSG_LSTM) {
    for (int r = 0; r < rows; ++r) {
      PSG_SIMD for (long j = 0; j < width; ++j) z[0][r][j] = NAME(sigmoid)(z[0][r][j]);
      PSG_SIMD for (long j = 0; j < width; ++j) z[1][r][j] = NAME(sigmoid)(z[1][r][j]);
      PSG_SIMD for (long j = 0; j < width; ++j) z[2][r][j] = TANH(z[2][r][j]);
      PSG_SIMD for (long j = 0; j < width; ++j) z[3][r][j] = NAME(sigmoid)(z[3][r][j]);
    }
    for (int r = 0; r < rows; ++r) {
      const long b = r0 + r;
      REAL *a = job->act + t * job->act_t + b * job->act_b + u;
      REAL *cd = job->cand + t * job->cand_t + b * job->cand_b + u;
      REAL *tc = job->tanh_c + t * job->tc_t + b * job->tc_b + u;
      const REAL *cp = job->cs + read * job->cs_t + b * job->cs_b + u;
      REAL *cn = job->cs + write * job->cs_t + b * job->cs_b + u;
      PSG_SIMD for (long j = 0; j < width; ++j) cn[j] = z[1][r][j] * cp[j] + z[0][r][j] * z[2][r][j];
      PSG_SIMD for (long j = 0; j < width; ++j) tc[j] = TANH(cn[j]);
      REAL *hn = job->hs + write * job->hs_t + b * job->hs_b + u;
      REAL *ho = h_out + psg_tile_row(b, H) + u * ROWS; /* its row of the k-major tiles */
      PSG_SIMD for (long j = 0; j < width; ++j) {
        a[j] = z[0][r][j];
        a[H + j] = z[1][r][j];
        a[2 * H + j] = z[2][r][j];
        a[3 * H + j] = z[3][r][j];
        cd[j] = z[2][r][j];
        hn[j] = z[3][r][j] * tc[j];
        ho[j * ROWS] = z[3][r][j] * tc[j];
      }
    }
  } else if (job->cell == PSG_GRU) {
    for (int r = 0; r < rows; ++r) {
      PSG_SIMD for (long j = 0; j < width; ++j) z[0][r][j] = NAME(sigmoid)(z[0][r][j]);
      PSG_SIMD for (long j = 0; j < width; ++j) z[1][r][j] = NAME(sigmoid)(z[1][r][j]);
    }
    for (int r = 0; r < rows; ++r) {
      const long b = r0 + r;
      const REAL *x = job->gx + b * job->gx_b + t * job->gx_t + u;
      REAL *a = job->act + t * job->act_t + b * job->act_b + u;
      REAL *cd = job->cand + t * job->cand_t + b * job->cand_b + u;
      const REAL *hp = job->hs + read * job->hs_t + b * job->hs_b + u;
      REAL *hn = job->hs + write * job->hs_t + b * job->hs_b + u;
      REAL *ho = h_out + psg_tile_row(b, H) + u * ROWS;
      PSG_SIMD for (long j = 0; j < width; ++j) cd[j] = x[2 * H + j] + z[0][r][j] * pre[2][r][j];
      PSG_SIMD for (long j = 0; j < width; ++j) cd[j] = TANH(cd[j]);
      PSG_SIMD for (long j = 0; j < width; ++j) {
        const REAL nn = cd[j];
        const REAL h = nn + z[1][r][j] * (hp[j] - nn);
        a[j] = z[0][r][j];
        a[H + j] = z[1][r][j];
        hn[j] = h;
        ho[j * ROWS] = h;
      }
    }
  } else {
    const int relu = job->cell == PSG_RNN_RELU;
    for (int r = 0; r < rows; ++r) {
      const long b = r0 + r;
      const REAL *x = job->gx + b * job->gx_b + t * job->gx_t + u;
      REAL *hn = job->hs + write * job->hs_t + b * job->hs_b + u;
      REAL *ho = h_out + psg_tile_row(b, H) + u * ROWS;
      PSG_SIMD for (long j = 0; j < width; ++j) {
        REAL s = pre[0][r][j] + x[j];
        REAL h = relu ? (s > 0 ? s : (REAL)0) : TANH(s);
        hn[j] = h;
        ho[j * ROWS] = h;
      }
    }
  }
}

static void NAME(forward_thread)(const struct NAME(job) *job, int index, int threads) {
  const long H = job->H, T = job->T;
  long u0, u1;
  NAME(units)(H, index, threads, &u0, &u1);
  REAL pre[4][ROWS][LANES];
  for (long p = 0; p < T; ++p) {
    const int t = (int)(job->reverse ? T - 1 - p : p);
    const int read = job->reverse ? t + 1 : t, write = job->reverse ? t : t + 1;
    const REAL *h_in = job->scratch + (p % 2) * job->Bp * H;
    REAL *h_out = job->scratch + ((p + 1) % 2) * job->Bp * H;
    for (long r0 = 0; r0 < job->Bp; r0 += ROWS)
      for (long u = u0; u < u1; u += LANES) {
        const long width = (u1 - u < LANES) ? u1 - u : LANES;
        NAME(gates_product)(job, h_in + r0 * H, u, width, pre);
        NAME(cell_forward)(job, pre, r0, u, width, t, read, write, h_out);
      }
#pragma omp barrier
  }
}

/* out[block][r][j] = sum_n g[n][r] W[n][k + j] for the thread's columns [k0, k1) of dh (g: a row
 * group's k-major (G*H, ROWS) tile of the padded gradients). */
PSG_FUSED static void NAME(backward_product)(const struct NAME(job) *job, long k0, long k1, const REAL *g,
                                   REAL out[][ROWS][LANES]) {
  const long H = job->H, GH = job->G * H;
  for (long k = k0; k < k1; k += 2 * LANES) {
    const long width = (k1 - k < 2 * LANES) ? k1 - k : 2 * LANES;
    const long block = (k - k0) / LANES;
    if (width == 2 * LANES) {
      VEC acc0[ROWS], acc1[ROWS];
      for (int r = 0; r < ROWS; ++r) { acc0[r] = (VEC){0}; acc1[r] = (VEC){0}; }
      MICROKERNEL(GH, g, job->w + k, job->w + k + LANES, H, acc0, acc1);
      for (int r = 0; r < ROWS; ++r) {
        *(VECU *)out[block][r] = acc0[r];
        *(VECU *)out[block + 1][r] = acc1[r];
      }
    } else {
      for (int r = 0; r < ROWS; ++r)
        for (long j = 0; j < width; ++j) {
          REAL s = 0;
          const REAL *w = job->w + k + j;
          for (long n = 0; n < GH; ++n) s = FMA(g[n * ROWS + r], w[n * H], s);
          out[block + j / LANES][r][j % LANES] = s;
        }
    }
  }
}

/* The cells' backward for one row b and the units [ub, ub + width): `dhv(j)` is the new h's total
 * gradient. Writes the gates' gradients (din, dhid, and the padded copy of dhid's row: e, its column of
 * the row group's k-major tile, stride ROWS), the
 * gradient reaching c_prev (LSTM, in dc) and the part of h_prev's that does not go through W_hh
 * (GRU's z term, in dh: added to the product at the next step). */
static void NAME(cell_backward)(const struct NAME(job) *job, long b, int t, long ub, long width,
                                const REAL *dhv, REAL *e) {
  const long H = job->H;
  REAL *din = job->din + b * job->din_b + t * job->din_t;
  REAL *dhid = job->dhid + b * job->dhid_b + t * job->dhid_t;
  REAL *dhb = job->dh + b * H;
  if (job->cell == PSG_LSTM) {
    const REAL *a = job->act + t * job->act_t + b * job->act_b;
    const REAL *cd = job->cand + t * job->cand_t + b * job->cand_b;
    const REAL *cp = job->cs + t * job->cs_t + b * job->cs_b;
    const REAL *tc = job->tanh_c + t * job->tc_t + b * job->tc_b;
    REAL *dcb = job->dc + b * H;
    PSG_SIMD for (long jj = 0; jj < width; ++jj) {
      const long j = ub + jj;
      REAL dh = dhv[jj];
      REAL i = a[j], f = a[H + j], g = cd[j], o = a[3 * H + j], th = tc[j];
      REAL dcn = dcb[j] + dh * (o - o * th * th);
      REAL di = dcn * g * (i - i * i);
      REAL df = dcn * cp[j] * (f - f * f);
      REAL dg = dcn * (i - i * g * g);
      REAL dO = dh * th * (o - o * o);
      din[j] = di; din[H + j] = df; din[2 * H + j] = dg; din[3 * H + j] = dO;
      e[j * ROWS] = di; e[(H + j) * ROWS] = df; e[(2 * H + j) * ROWS] = dg; e[(3 * H + j) * ROWS] = dO;
      dcb[j] = dcn * f;
      dhb[j] = 0;
    }
  } else if (job->cell == PSG_GRU) {
    const REAL *a = job->act + t * job->act_t + b * job->act_b;
    const REAL *cd = job->cand + t * job->cand_t + b * job->cand_b;
    const REAL *hn = job->tanh_c + t * job->tc_t + b * job->tc_b; /* W_hn h_prev + b_hn */
    const REAL *hp = job->hs + t * job->hs_t + b * job->hs_b;
    PSG_SIMD for (long jj = 0; jj < width; ++jj) {
      const long j = ub + jj;
      REAL dh = dhv[jj];
      REAL r = a[j], z = a[H + j], n = cd[j];
      REAL d_n = dh * ((REAL)1 - z) * ((REAL)1 - n * n);
      REAL d_z = dh * (hp[j] - n) * (z - z * z);
      REAL d_r = d_n * hn[j] * (r - r * r);
      din[j] = d_r; din[H + j] = d_z; din[2 * H + j] = d_n;
      dhid[j] = d_r; dhid[H + j] = d_z; dhid[2 * H + j] = d_n * r;
      e[j * ROWS] = d_r; e[(H + j) * ROWS] = d_z; e[(2 * H + j) * ROWS] = d_n * r;
      dhb[j] = dh * z;
    }
  } else {
    const REAL *h = job->hs + t * job->hs_t + b * job->hs_b; /* the step's new h */
    const int relu = job->cell == PSG_RNN_RELU;
    PSG_SIMD for (long jj = 0; jj < width; ++jj) {
      const long j = ub + jj;
      REAL slope = relu ? (h[j] > 0 ? (REAL)1 : (REAL)0) : (REAL)1 - h[j] * h[j];
      REAL d = dhv[jj] * slope;
      din[j] = d;
      e[j * ROWS] = d;
      dhb[j] = 0;
    }
  }
}

static void NAME(backward_thread)(const struct NAME(job) *job, int index, int threads) {
  const long B = job->B, H = job->H, GH = job->G * H, T = job->T;
  long u0, u1;
  NAME(units)(H, index, threads, &u0, &u1);
  /* the product's result for the thread's columns and one row group: blocks x ROWS x LANES */
  REAL(*prod)[ROWS][LANES] = (REAL(*)[ROWS][LANES])job->product + index * job->product_stride;
  REAL dhv[LANES];
  for (long p = 0; p <= T; ++p) {
    /* steps in backward order; p == T computes h0's gradient from the first step's gates */
    const int t = (int)(job->reverse ? p : T - 1 - p);
    const REAL *g_next = job->scratch + (p % 2) * job->Bp * GH; /* the later step's hidden-gate gradients */
    REAL *g_out = job->scratch + ((p + 1) % 2) * job->Bp * GH;
    if (u0 < u1) {
      for (long r0 = 0; r0 < job->Bp; r0 += ROWS) {
        if (p > 0) NAME(backward_product)(job, u0, u1, g_next + r0 * GH, prod);
        for (int r = 0; r < ROWS && r0 + r < B; ++r) {
          const long b = r0 + r;
          REAL *dhb = job->dh + b * H;
          if (p == T) { /* h0's gradient: through W_hh, and GRU's z term */
            for (long j = u0; j < u1; ++j) dhb[j] += prod[(j - u0) / LANES][r][(j - u0) % LANES];
            continue;
          }
          const REAL *dy = job->dout + b * job->do_b + t * job->do_t;
          for (long ub = u0; ub < u1; ub += LANES) {
            const long width = (u1 - ub < LANES) ? u1 - ub : LANES;
            const REAL *pr = prod[(ub - u0) / LANES][r];
            /* the new h's total gradient: its output's, plus the later steps' (the product and
               the carried term, p > 0) or the final state's (p == 0); both are held in dh */
            PSG_SIMD for (long jj = 0; jj < width; ++jj)
              dhv[jj] = dy[ub + jj] + dhb[ub + jj] + (p > 0 ? pr[jj] : (REAL)0);
            NAME(cell_backward)(job, b, t, ub, width, dhv, g_out + psg_tile_row(b, GH));
          }
        }
      }
    }
    if (p < T) {
#pragma omp barrier
    }
  }
}

static long NAME(gates)(int cell) { return cell == PSG_LSTM ? 4 : cell == PSG_GRU ? 3 : 1; }

/* The forward time loop on up to `threads` threads. Returns 0, or -1 when memory could not be had
 * (nothing was computed then, and the caller falls back). */
int NAME(forward_sequence)(int cell, long B, long H, long T, int reverse, int threads,
                           const REAL *gx, long gx_b, long gx_t, const REAL *wt, const REAL *bias,
                           REAL *hg, long hg_b, long hg_t, REAL *act, long act_t, long act_b,
                           REAL *cand, long cand_t, long cand_b, REAL *tanh_c, long tc_t, long tc_b,
                           REAL *hs, long hs_t, long hs_b, REAL *cs, long cs_t, long cs_b) {
  const long Bp = (B + ROWS - 1) / ROWS * ROWS;
  const long blocks = (H + LANES - 1) / LANES;
  if (threads > blocks) threads = (int)blocks;
  if (threads < 1) threads = 1;
  REAL *scratch = (REAL *)calloc((size_t)(2 * Bp * H), sizeof(REAL));
  if (scratch == NULL) return -1;
  const long first = reverse ? T : 0;
  for (long b = 0; b < B; ++b) /* the initial state, in the row groups' k-major (H, ROWS) tiles */
    for (long n = 0; n < H; ++n) scratch[psg_tile_row(b, H) + n * ROWS] = hs[first * hs_t + b * hs_b + n];
  struct NAME(job) job = {0};
  job.cell = cell; job.B = B; job.H = H; job.T = T; job.Bp = Bp; job.G = NAME(gates)(cell);
  job.reverse = reverse;
  job.gx = gx; job.gx_b = gx_b; job.gx_t = gx_t; job.wt = wt; job.bias = bias;
  job.hg = hg; job.hg_b = hg_b; job.hg_t = hg_t;
  job.act = act; job.act_t = act_t; job.act_b = act_b;
  job.cand = cand; job.cand_t = cand_t; job.cand_b = cand_b;
  job.tanh_c = tanh_c; job.tc_t = tc_t; job.tc_b = tc_b;
  job.hs = hs; job.hs_t = hs_t; job.hs_b = hs_b;
  job.cs = cs; job.cs_t = cs_t; job.cs_b = cs_b;
  job.scratch = scratch;
  if (threads == 1) {
    NAME(forward_thread)(&job, 0, 1); /* no parallel region: usable in a forked child (see native.py) */
  } else {
#pragma omp parallel num_threads(threads)
    NAME(forward_thread)(&job, PSG_THREAD_INDEX(), PSG_THREAD_COUNT());
  }
  free(scratch);
  return 0;
}

/* The backward time loop on up to `threads` threads: the gates' gradients (din, and dhid where it
 * differs: the GRU's) from the outputs' gradients; in place, the final state's gradients (dh, dc:
 * (B, H) contiguous; dc the LSTM's only) become the initial state's. It reads what the forward
 * wrote. Returns 0, or -1 when memory could not be had (nothing computed: the caller falls back). */
int NAME(backward_sequence)(int cell, long B, long H, long T, int reverse, int threads, const REAL *w,
                            const REAL *act, long act_t, long act_b,
                            const REAL *cand, long cand_t, long cand_b, const REAL *tanh_c, long tc_t,
                            long tc_b, const REAL *hs, long hs_t, long hs_b, const REAL *cs, long cs_t,
                            long cs_b, const REAL *dout, long do_b, long do_t, REAL *dh, REAL *dc,
                            REAL *din, long din_b, long din_t, REAL *dhid, long dhid_b, long dhid_t) {
  const long G = NAME(gates)(cell);
  const long Bp = (B + ROWS - 1) / ROWS * ROWS;
  const long blocks = (H + LANES - 1) / LANES;
  if (threads > blocks) threads = (int)blocks;
  if (threads < 1) threads = 1;
  REAL *scratch = (REAL *)calloc((size_t)(2 * Bp * G * H), sizeof(REAL));
  /* a thread owns at most all the blocks (OpenMP may grant fewer threads than asked for); one
     spare for the product's last pair of blocks */
  const long product_stride = blocks + 1;
  REAL *product = (REAL *)malloc(sizeof(REAL) * ROWS * LANES * product_stride * threads);
  if (scratch == NULL || product == NULL) {
    free(scratch);
    free(product);
    return -1;
  }
  struct NAME(job) job = {0};
  job.cell = cell; job.B = B; job.H = H; job.T = T; job.Bp = Bp; job.G = G; job.reverse = reverse;
  job.w = w;
  job.act = (REAL *)act; job.act_t = act_t; job.act_b = act_b;
  job.cand = (REAL *)cand; job.cand_t = cand_t; job.cand_b = cand_b;
  job.tanh_c = (REAL *)tanh_c; job.tc_t = tc_t; job.tc_b = tc_b;
  job.hs = (REAL *)hs; job.hs_t = hs_t; job.hs_b = hs_b;
  job.cs = (REAL *)cs; job.cs_t = cs_t; job.cs_b = cs_b;
  job.dout = dout; job.do_b = do_b; job.do_t = do_t; job.dh = dh; job.dc = dc;
  job.din = din; job.din_b = din_b; job.din_t = din_t;
  job.dhid = dhid; job.dhid_b = dhid_b; job.dhid_t = dhid_t;
  job.scratch = scratch; job.product = product; job.product_stride = product_stride;
  if (threads == 1) {
    NAME(backward_thread)(&job, 0, 1);
  } else {
#pragma omp parallel num_threads(threads)
    {
      /* a thread beyond the count asked for (never, by OpenMP's rules) would find no product buffer */
      int index = PSG_THREAD_INDEX(), count = PSG_THREAD_COUNT();
      if (count <= threads) NAME(backward_thread)(&job, index, count);
    }
  }
  free(scratch);
  free(product);
  return 0;
}

#undef MICROKERNEL
#undef MICROKERNEL1
