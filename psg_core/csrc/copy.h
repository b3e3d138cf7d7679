/* A strided matrix copied into a contiguous one: out (rows, cols) row-major <- src with element
 * strides (sr, sc). torch's CPU copy of a transposed matrix (a weight's .t().contiguous(), a
 * product's transposed result made dense) reads one operand with a large stride element by
 * element: about 6x the time of a plain copy of the same bytes on the 2-core AMD EPYC (a
 * (1024, 256) float32 matrix, 0.16-0.24 ms against 0.03). Here the matrix goes through a
 * TILE x TILE block held in registers and L1: the reads of a tile's columns and the writes of its
 * rows each touch TILE cache lines, so every line is read and written once (0.08 ms for the
 * same matrix).
 *
 * Included by recurrence.c once per type with REAL and NAME(x) defined (see sequence.h).
 */

#ifndef PSG_COPY_COMMON
#define PSG_COPY_COMMON
#define PSG_TILE 16
#endif

void NAME(strided_copy)(long rows, long cols, const REAL *src, long sr, long sc, REAL *out) {
  if (sc == 1) { /* rows of unit stride: one copy per row */
    for (long i = 0; i < rows; ++i) memcpy(out + i * cols, src + i * sr, (size_t)cols * sizeof(REAL));
    return;
  }
  REAL tile[PSG_TILE][PSG_TILE];
  for (long j0 = 0; j0 < cols; j0 += PSG_TILE) {
    const long nj = (cols - j0 < PSG_TILE) ? cols - j0 : PSG_TILE;
    for (long i0 = 0; i0 < rows; i0 += PSG_TILE) {
      const long ni = (rows - i0 < PSG_TILE) ? rows - i0 : PSG_TILE;
      if (ni == PSG_TILE && nj == PSG_TILE) {
        /* the tile's columns, each read along src's rows (contiguous in a transpose: sr == 1) */
        if (sr == 1) {
          for (long j = 0; j < PSG_TILE; ++j) {
            const REAL *s = src + i0 + (j0 + j) * sc;
            for (long i = 0; i < PSG_TILE; ++i) tile[j][i] = s[i];
          }
        } else {
          for (long j = 0; j < PSG_TILE; ++j) {
            const REAL *s = src + i0 * sr + (j0 + j) * sc;
            for (long i = 0; i < PSG_TILE; ++i) tile[j][i] = s[i * sr];
          }
        }
        for (long i = 0; i < PSG_TILE; ++i) {
          REAL *o = out + (i0 + i) * cols + j0;
          for (long j = 0; j < PSG_TILE; ++j) o[j] = tile[j][i];
        }
      } else {
        for (long i = i0; i < i0 + ni; ++i)
          for (long j = j0; j < j0 + nj; ++j) out[i * cols + j] = src[i * sr + j * sc];
      }
    }
  }
}
