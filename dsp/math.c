/* The math helpers a `dsp` programs library needs and the Hexagon v65 has no instruction for,
   compiled into every programs library (runner/targets.py HEXAGON sources, appended to its
   one translation unit, since ld.lld-19 concatenates the Hexagon attribute sections of two
   objects into one that llvm-objdump cannot read), hidden: the
   programs then import nothing but what the DSP's C library surely has (memcpy, memmove,
   memset, the integer division helpers: runner/targets.py DSP_C_LIBRARY), on the DSP and under
   qemu alike.

   clang lowers float division, float <-> integer conversions, fma, exp's and log's polynomials
   (compiler/codegen/transcendental.py) to v65 instructions; square roots become calls:
     __hexagon_sqrtf  float32 Sqrt (scalar, and each lane of a vector one)
     sqrt             float64 Sqrt
   Both are correctly rounded (IEEE 754 round to nearest even), from an integer square root,
   so neither calls a floating-point helper back. float64 arithmetic itself (__hexagon_adddf3
   and friends) is soft-float on v65 and is not provided here: the toolchain refuses it, naming
   the op. Built freestanding: no libc header, <stdint.h> only. */
#include <stdint.h>

/* floor(sqrt(m * 2^64)) for m < 2^60, digit by digit (two input bits per result bit); sets
   *inexact when the root is not exact */
static uint64_t keel_root64(uint64_t m, int *inexact) {
  uint64_t root = 0, rem = 0;
  for (int i = 62; i >= -64; i -= 2) {
    rem = rem << 2 | (i >= 0 ? m >> i & 3 : 0);
    uint64_t trial = root << 2 | 1;
    root <<= 1;
    if (rem >= trial) rem -= trial, root |= 1;
  }
  *inexact = rem != 0;
  return root;
}

/* The square root of a finite positive IEEE number with `mant` fraction bits and exponent
   `bias`, given its fields (exponent field e, fraction f); returns the result's bits. */
static uint64_t keel_sqrt_bits(uint64_t e, uint64_t f, int mant, int bias) {
  int64_t exp = e ? (int64_t)e - bias - mant : 1 - bias - mant;  /* x = m * 2^exp */
  uint64_t m = e ? f | (uint64_t)1 << mant : f;
  while (!(m >> mant)) m <<= 1, exp--;  /* subnormal: normalize, every root bit counts */
  if (exp & 1) m <<= 1, exp--;  /* sqrt(m * 2^exp) = sqrt(m * 2^64) * 2^(exp/2 - 32) */
  int inexact;
  uint64_t root = keel_root64(m, &inexact);
  int top = 63;
  while (!(root >> top)) top--;
  int drop = top - mant;  /* keep mant + 1 bits; the rest round */
  uint64_t kept = root >> drop, rest = root & (((uint64_t)1 << drop) - 1);
  uint64_t half = (uint64_t)1 << (drop - 1);
  if (rest > half || (rest == half && (inexact || (kept & 1)))) kept++;
  int64_t biased = exp / 2 - 32 + drop + mant + bias;
  if (kept >> (mant + 1)) kept >>= 1, biased++;  /* rounding carried into a new bit */
  return (uint64_t)biased << mant | (kept & (((uint64_t)1 << mant) - 1));
}

__attribute__((visibility("hidden"))) float __hexagon_sqrtf(float x) {
  union { float f; uint32_t u; } v = {x};
  uint32_t e = v.u >> 23 & 0xff, f = v.u & 0x7fffff;
  if (e == 0xff && f) v.u |= 0x400000;            /* NaN: quieted */
  else if (v.u >> 31 && (v.u << 1)) v.u = 0x7fc00000;  /* negative, not -0: NaN */
  else if (e != 0xff && (v.u << 1)) v.u = (uint32_t)keel_sqrt_bits(e, f, 23, 127);
  return v.f;                                      /* +-0 and +inf are their own roots */
}

__attribute__((visibility("hidden"))) double sqrt(double x) {
  union { double f; uint64_t u; } v = {x};
  uint64_t e = v.u >> 52 & 0x7ff, f = v.u & 0xfffffffffffffull;
  if (e == 0x7ff && f) v.u |= 0x8000000000000ull;
  else if (v.u >> 63 && (v.u << 1)) v.u = 0x7ff8000000000000ull;
  else if (e != 0x7ff && (v.u << 1)) v.u = keel_sqrt_bits(e, f, 52, 1023);
  return v.f;
}
