/* Records the KGSL UAPI facts keel's qcom/kgsl.py relies on, as the compiler sees them in the real
 * header: struct sizes, field offsets and ioctl numbers. Compiled (never run) for each target; the
 * facts land in two sections that tests/qcom_uapi_regen.py reads back out of the object file.
 *   clang-19 --target=aarch64-linux-gnu -D__user= -I <dir holding linux/msm_kgsl.h> -c ...
 */
#include <stddef.h>
#include <linux/msm_kgsl.h>

#define SIZE(s) X("sizeof " #s, sizeof(struct s))
#define OFF(s, f) X("offsetof " #s "." #f, offsetof(struct s, f))
#define NUM(n) X(#n, n)

#define FACTS \
  SIZE(kgsl_devinfo) OFF(kgsl_devinfo, chip_id) OFF(kgsl_devinfo, gmem_gpubaseaddr) \
  OFF(kgsl_devinfo, gpu_id) OFF(kgsl_devinfo, gmem_sizebytes) \
  SIZE(kgsl_version) OFF(kgsl_version, dev_minor) \
  SIZE(kgsl_device_getproperty) OFF(kgsl_device_getproperty, value) \
  OFF(kgsl_device_getproperty, sizebytes) \
  SIZE(kgsl_device_waittimestamp_ctxtid) OFF(kgsl_device_waittimestamp_ctxtid, timeout) \
  SIZE(kgsl_cmdstream_readtimestamp_ctxtid) OFF(kgsl_cmdstream_readtimestamp_ctxtid, timestamp) \
  SIZE(kgsl_drawctxt_create) OFF(kgsl_drawctxt_create, drawctxt_id) \
  SIZE(kgsl_drawctxt_destroy) \
  SIZE(kgsl_map_user_mem) OFF(kgsl_map_user_mem, gpuaddr) OFF(kgsl_map_user_mem, len) \
  OFF(kgsl_map_user_mem, offset) OFF(kgsl_map_user_mem, hostptr) \
  OFF(kgsl_map_user_mem, memtype) OFF(kgsl_map_user_mem, flags) \
  SIZE(kgsl_gpuobj_alloc) OFF(kgsl_gpuobj_alloc, mmapsize) OFF(kgsl_gpuobj_alloc, id) \
  OFF(kgsl_gpuobj_alloc, metadata) \
  SIZE(kgsl_gpuobj_free) OFF(kgsl_gpuobj_free, id) OFF(kgsl_gpuobj_free, len) \
  SIZE(kgsl_gpuobj_info) OFF(kgsl_gpuobj_info, gpuaddr) OFF(kgsl_gpuobj_info, size) \
  OFF(kgsl_gpuobj_info, va_addr) OFF(kgsl_gpuobj_info, id) \
  SIZE(kgsl_gpuobj_import) OFF(kgsl_gpuobj_import, priv_len) OFF(kgsl_gpuobj_import, type) \
  OFF(kgsl_gpuobj_import, id) SIZE(kgsl_gpuobj_import_useraddr) \
  SIZE(kgsl_gpuobj_import_dma_buf) \
  SIZE(kgsl_command_object) OFF(kgsl_command_object, gpuaddr) OFF(kgsl_command_object, size) \
  OFF(kgsl_command_object, flags) OFF(kgsl_command_object, id) \
  SIZE(kgsl_command_syncpoint) OFF(kgsl_command_syncpoint, type) \
  SIZE(kgsl_gpu_command) OFF(kgsl_gpu_command, cmdlist) OFF(kgsl_gpu_command, cmdsize) \
  OFF(kgsl_gpu_command, numcmds) OFF(kgsl_gpu_command, objlist) OFF(kgsl_gpu_command, synclist) \
  OFF(kgsl_gpu_command, numsyncs) OFF(kgsl_gpu_command, context_id) \
  OFF(kgsl_gpu_command, timestamp) \
  NUM(IOCTL_KGSL_DEVICE_GETPROPERTY) NUM(IOCTL_KGSL_DEVICE_WAITTIMESTAMP_CTXTID) \
  NUM(IOCTL_KGSL_DRAWCTXT_CREATE) NUM(IOCTL_KGSL_DRAWCTXT_DESTROY) NUM(IOCTL_KGSL_MAP_USER_MEM) \
  NUM(IOCTL_KGSL_CMDSTREAM_READTIMESTAMP_CTXTID) NUM(IOCTL_KGSL_GPUOBJ_ALLOC) \
  NUM(IOCTL_KGSL_GPUOBJ_FREE) NUM(IOCTL_KGSL_GPUOBJ_INFO) NUM(IOCTL_KGSL_GPUOBJ_IMPORT) \
  NUM(IOCTL_KGSL_GPU_COMMAND) \
  NUM(KGSL_CONTEXT_NO_GMEM_ALLOC) NUM(KGSL_CONTEXT_PREAMBLE) NUM(KGSL_CONTEXT_PER_CONTEXT_TS) \
  NUM(KGSL_CONTEXT_NO_FAULT_TOLERANCE) NUM(KGSL_CONTEXT_PRIORITY_MASK) \
  NUM(KGSL_CONTEXT_PRIORITY_SHIFT) NUM(KGSL_CONTEXT_TYPE_MASK) NUM(KGSL_CONTEXT_TYPE_SHIFT) \
  NUM(KGSL_CONTEXT_TYPE_CL) NUM(KGSL_CONTEXT_PREEMPT_STYLE_MASK) \
  NUM(KGSL_CONTEXT_PREEMPT_STYLE_SHIFT) NUM(KGSL_CONTEXT_PREEMPT_STYLE_RINGBUFFER) \
  NUM(KGSL_CONTEXT_PREEMPT_STYLE_FINEGRAIN) NUM(KGSL_CONTEXT_INVALIDATE_ON_FAULT) \
  NUM(KGSL_CMDLIST_IB) NUM(KGSL_MEMFLAGS_GPUREADONLY) NUM(KGSL_MEMFLAGS_USE_CPU_MAP) \
  NUM(KGSL_MEMFLAGS_IOCOHERENT) NUM(KGSL_CACHEMODE_MASK) NUM(KGSL_CACHEMODE_SHIFT) \
  NUM(KGSL_CACHEMODE_WRITECOMBINE) NUM(KGSL_CACHEMODE_UNCACHED) \
  NUM(KGSL_CACHEMODE_WRITETHROUGH) NUM(KGSL_CACHEMODE_WRITEBACK) NUM(KGSL_MEMTYPE_MASK) \
  NUM(KGSL_MEMTYPE_SHIFT) NUM(KGSL_MEMTYPE_CL) NUM(KGSL_MEMTYPE_COMMAND) NUM(KGSL_MEMALIGN_MASK) \
  NUM(KGSL_MEMALIGN_SHIFT) NUM(KGSL_USER_MEM_TYPE_ADDR) NUM(KGSL_USER_MEM_TYPE_DMABUF) \
  NUM(KGSL_PROP_DEVICE_INFO) \
  NUM(KGSL_PROP_VERSION) NUM(KGSL_TIMESTAMP_CONSUMED) NUM(KGSL_TIMESTAMP_RETIRED) \
  NUM(KGSL_TIMESTAMP_QUEUED)

#define X(name, value) name "\n"
__attribute__((section(".keel_names"), used)) const char keel_names[] = FACTS;
#undef X
#define X(name, value) (unsigned long long)(value),
__attribute__((section(".keel_facts"), used)) const unsigned long long keel_facts[] = {FACTS};
