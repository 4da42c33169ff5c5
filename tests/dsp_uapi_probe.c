/* Records the FastRPC UAPI facts keel's dsp/fastrpc.py relies on, as the compiler sees them in
 * the real header (drivers/char/adsprpc_shared.h): struct sizes, field offsets, ioctl numbers and
 * constants. Compiled (never run) by tests/dsp_uapi_regen.py, like tests/qcom_uapi_probe.c.
 * The header is kernel-internal: it takes its integer types from the kernel's linux/types.h, which
 * the uapi linux/types.h lacks. Both targets are LP64, so they are spelled here. */
#include <stddef.h>
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long uint64_t, uintptr_t;
typedef long ssize_t;
#include <linux/ioctl.h>  /* the driver includes it before the header */
#include <linux/adsprpc_shared.h>

#define SIZE(s) X("sizeof " #s, sizeof(struct s))
#define OFF(s, f) X("offsetof " #s "." #f, offsetof(struct s, f))
#define NUM(n) X(#n, n)

#define FACTS \
  X("sizeof remote_arg", sizeof(union remote_arg)) SIZE(remote_buf) OFF(remote_buf, len) \
  SIZE(fastrpc_ioctl_invoke) OFF(fastrpc_ioctl_invoke, sc) OFF(fastrpc_ioctl_invoke, pra) \
  SIZE(fastrpc_ioctl_invoke_fd) OFF(fastrpc_ioctl_invoke_fd, fds) \
  SIZE(fastrpc_ioctl_invoke_attrs) OFF(fastrpc_ioctl_invoke_attrs, attrs) \
  SIZE(fastrpc_ioctl_init) OFF(fastrpc_ioctl_init, file) OFF(fastrpc_ioctl_init, filelen) \
  OFF(fastrpc_ioctl_init, filefd) OFF(fastrpc_ioctl_init, mem) OFF(fastrpc_ioctl_init, memlen) \
  OFF(fastrpc_ioctl_init, memfd) \
  SIZE(fastrpc_ioctl_init_attrs) OFF(fastrpc_ioctl_init_attrs, attrs) \
  OFF(fastrpc_ioctl_init_attrs, siglen) \
  SIZE(fastrpc_ioctl_mmap) OFF(fastrpc_ioctl_mmap, flags) OFF(fastrpc_ioctl_mmap, vaddrin) \
  OFF(fastrpc_ioctl_mmap, size) OFF(fastrpc_ioctl_mmap, vaddrout) \
  SIZE(fastrpc_ioctl_munmap) OFF(fastrpc_ioctl_munmap, size) \
  NUM(FASTRPC_IOCTL_INVOKE) NUM(FASTRPC_IOCTL_MMAP) NUM(FASTRPC_IOCTL_MUNMAP) \
  NUM(FASTRPC_IOCTL_INVOKE_FD) NUM(FASTRPC_IOCTL_INIT) NUM(FASTRPC_IOCTL_INVOKE_ATTRS) \
  NUM(FASTRPC_IOCTL_GETINFO) NUM(FASTRPC_IOCTL_INIT_ATTRS) \
  NUM(FASTRPC_INIT_ATTACH) NUM(FASTRPC_INIT_CREATE) \
  X("REMOTE_SCALARS_MAKE(2, 1, 1)", REMOTE_SCALARS_MAKE(2, 1, 1)) \
  X("REMOTE_SCALARS_MAKE(0, 2, 2)", REMOTE_SCALARS_MAKE(0, 2, 2)) \
  X("REMOTE_SCALARS_MAKE(1, 1, 2)", REMOTE_SCALARS_MAKE(1, 1, 2))

#define X(name, value) name "\n"
__attribute__((section(".keel_names"), used)) const char keel_names[] = FACTS;
#undef X
#define X(name, value) (unsigned long long)(value),
__attribute__((section(".keel_facts"), used)) const unsigned long long keel_facts[] = {FACTS};
