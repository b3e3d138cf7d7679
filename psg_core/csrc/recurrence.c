/* psg's native CPU kernels: a recurrent direction's whole time loop (LSTM, GRU, RNN), forward and
 * backward; an EmbeddingBag's ghost norms and clipped sum (table.h); ghost clipping's float64 Gram
 * matrices of float32 rows (gram.h).
 *
 * psg's DP recurrent layers run their time loop step by step: per step one matrix product with
 * the hidden weight and the cell's pointwise ops. From Python each step costs a product call
 * (oneDNN's has about 10 us of fixed cost per call) and the pointwise ops (seven torch calls
 * forward, five backward): at a DP LSTM's usual sizes (batch 8, hidden 256) that overhead is most
 * of the step. Here the whole loop is one call: the product (a register-blocked microkernel on
 * GCC vector types, which the compiler maps to the host's widest SIMD), the pointwise cell fused
 * after it, and the steps split over torch's OpenMP threads by hidden units with one barrier per step (see
 * sequence.h). Float32 and float64. Loaded with ctypes by psg_core.native; the step-by-step
 * loop in Python is the fallback and the reference the tests compare with.
 *
 * Gates are ordered as torch's: input i, forget f, cell candidate g, output o, each H wide.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
/* libmvec's vector variants (glibc >= 2.35 for tanh): the loops below call exp and tanh on whole
 * vectors where the compiler vectorises them */
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) float tanhf(float);
__attribute__((simd("notinbranch"))) double exp(double);
__attribute__((simd("notinbranch"))) double tanh(double);
#endif

#define PSG_SIMD _Pragma("omp simd")

/* The products' multiply-adds fused (one rounding each, as BLAS computes them): ISO C mode turns
 * the contraction off, and the microkernel then issued a multiply and an add per step (the LSTM
 * forward loop at 44 against 48 GFLOP/s, one AMD EPYC core). Only in the product functions, whose
 * vector and scalar paths both fuse, in the same order: the results stay independent of the
 * thread count (which decides which units take which path). */
#if defined(__GNUC__) && !defined(__clang__)
#define PSG_FUSED __attribute__((optimize("fp-contract=fast")))
#else
#define PSG_FUSED
#endif

/* ------------------------------------------------------------------------------ threads */
/* The threads are OpenMP's, and psg_core.native links the OpenMP runtime torch has loaded: the
 * loops run on torch's own thread pool, whose workers are still spinning from torch's last
 * parallel op. (Threads of a second pool would compete with those spinning workers for the same
 * cores: measured, that made the loop slower than the step-by-step one.) Built without OpenMP,
 * the loops run on the calling thread. */
#ifdef _OPENMP
#include <omp.h>
#define PSG_THREAD_INDEX() omp_get_thread_num()
#define PSG_THREAD_COUNT() omp_get_num_threads()
#else
#define PSG_THREAD_INDEX() 0
#define PSG_THREAD_COUNT() 1
#endif

/* ------------------------------------------------------------------------------ the loops */
#if defined(__AVX512F__)
#define ROWS 8
#else
#define ROWS 4
#endif
#define VEC_BYTES 64

enum { PSG_LSTM = 0, PSG_GRU = 1, PSG_RNN_TANH = 2, PSG_RNN_RELU = 3 };

#define REAL float
#define LANES (VEC_BYTES / 4)
typedef float psg_vf __attribute__((vector_size(VEC_BYTES)));
typedef float psg_vfu __attribute__((vector_size(VEC_BYTES), aligned(4)));
#define VEC psg_vf
#define VECU psg_vfu
#define EXP expf
#define TANH tanhf
#define FMA fmaf
#define NAME(x) psg_f32_##x
#include "sequence.h"
#include "table.h"
#include "copy.h"
#include "gram.h"
#undef REAL
#undef LANES
#undef VEC
#undef VECU
#undef EXP
#undef TANH
#undef FMA
#undef NAME

#define REAL double
#define LANES (VEC_BYTES / 8)
typedef double psg_vd __attribute__((vector_size(VEC_BYTES)));
typedef double psg_vdu __attribute__((vector_size(VEC_BYTES), aligned(8)));
#define VEC psg_vd
#define VECU psg_vdu
#define EXP exp
#define TANH tanh
#define FMA fma
#define NAME(x) psg_f64_##x
#include "sequence.h"
#include "table.h"
#include "copy.h"
#include "gram.h"

/* The library's interface version: psg_core.native refuses a library built from another source. */
int psg_native_version(void) { return 10; }
