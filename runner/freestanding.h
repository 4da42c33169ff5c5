/* What keel's freestanding programs (sim/dsp/runtime.c; tests/aarch64/harness.c) need from the C
   library they run without: the memory functions a compiled kernel object may import (clang
   calls them for large copies, and the loader resolves the object's imports to these), and the
   string and exit helpers the programs themselves use.

   The includer first defines SYS(n, a, b, c) (a system call on its architecture), the numbers
   SYS_write and SYS_exit_group, and NAME, the prefix of its error messages. */
#include <stddef.h>

void *memcpy(void *d, const void *s, size_t n) {
  char *o = d;
  const char *i = s;
  while (n--) *o++ = *i++;
  return d;
}
void *memmove(void *d, const void *s, size_t n) {
  char *o = d;
  const char *i = s;
  if (o < i) return memcpy(d, s, n);
  while (n--) o[n] = i[n];
  return d;
}
void *memset(void *d, int c, size_t n) {
  char *o = d;
  while (n--) *o++ = (char)c;
  return d;
}
static size_t len(const char *s) {
  size_t n = 0;
  while (s[n]) n++;
  return n;
}
static int same(const char *a, const char *b) {
  while (*a && *a == *b) a++, b++;
  return *a == *b;
}
/* "NAME: what detail" on stderr, then exit with `code` */
static _Noreturn void die(int code, const char *what, const char *detail) {
  SYS(SYS_write, 2, NAME ": ", sizeof NAME + 1);
  SYS(SYS_write, 2, what, len(what));
  SYS(SYS_write, 2, detail, len(detail));
  SYS(SYS_write, 2, "\n", 1);
  SYS(SYS_exit_group, code, 0, 0);
  __builtin_unreachable();
}
