"""The PSP: its bootloader's components and sOS's GPCOM ring, from psp_gfx_if.h (torvalds/linux
041e6916), amdgpu_psp.h and amdgpu_ucode.h as facts: what the driver writes and the mock PSP
reads, in one place.

A ring frame (psp_gfx_rb_frame, 64 bytes): command buffer address lo, hi, its size, fence
address lo, hi, fence value, then SID, VMID, frame type and reserved words (0 on GPCOM). The
command buffer (psp_gfx_cmd_resp, 1024 bytes): buf_size, buf_version (1), cmd_id, four RBI-only
words (0), the command's fields at +28, and the response at +864 (psp_gfx_resp: status first).
The PSP writes the 32-bit fence value once the response is in place.
"""
from __future__ import annotations

import struct

FRAME = struct.Struct("<6I")  # cmd lo, hi, size, fence lo, hi, value (then 40 zero bytes)
FRAME_BYTES, CMD_BYTES, CMD_AT, RESP_AT = 64, 1024, 28, 864
CMD_HEAD_BYTES = 64  # the head (28) and every command's fields this driver sends (<= 24)
HEAD = struct.Struct("<7I")  # buf_size, buf_version, cmd_id, resp_buf lo, hi, offset, size
BUF_VERSION = 1
# psp_gfx_cmd_id
SETUP_TMR, LOAD_IP_FW, LOAD_TOC, AUTOLOAD_RLC = 0x5, 0x6, 0x20, 0x21
UNKNOWN_COMMAND = 0x100  # PSP_ERR_UNKNOWN_COMMAND
# psp_gfx_cmd_setup_tmr: address lo, hi (4 KiB aligned), size (multiple of 4 KiB), flags (bit 1
# virt_phy_addr: the system address below is given too), system address lo, hi;
# psp_gfx_cmd_load_ip_fw: address lo, hi (4 KiB aligned), size, fw_type; psp_gfx_cmd_load_toc:
# address lo, hi, size
SETUP = struct.Struct("<6I")
LOAD = struct.Struct("<4I")
TOC = struct.Struct("<3I")
VIRT_PHY_ADDR = 1 << 1
TMR_SIZE_AT = RESP_AT + 16  # psp_gfx_resp.tmr_size: LOAD_TOC's answer
TMR_BYTES = 4 << 20  # amdgpu's PSP_TMR_SIZE for a discrete card, when the sOS file has no TOC
TMR_ALIGN = 1 << 20  # PSP_TMR_ALIGNMENT

# amdgpu_ucode.h enum psp_fw_type: the components of the sOS file (psp_firmware_header_v2_0)
SOS, SYS_DRV, KDB, TOC_BIN, SPL, RL, SOC_DRV, INTF_DRV, DBG_DRV, RAS_DRV = range(1, 11)
# amdgpu_psp.h enum psp_bootloader_cmd, in the order psp_hw_start hands components to the
# bootloader (psp_v13_0.c: C2PMSG_36 = the image's address >> 20, C2PMSG_35 = the command);
# sOS last, after which C2PMSG_81 (sign of life) turns non-zero
BOOT = ((KDB, 0x80000), (SPL, 0x10000000), (SYS_DRV, 0x10000), (SOC_DRV, 0xB0000),
        (INTF_DRV, 0xD0000), (DBG_DRV, 0xC0000), (RAS_DRV, 0xE0000), (SOS, 0x20000))
BL_IMAGE_BYTES = 1 << 20  # PSP_1_MEG: the bootloader's image buffer (fw_pri_buf)

# psp_gfx_if.h enum psp_gfx_fw_type: what LOAD_IP_FW loads (the SOC21 ones for gfx11)
RLC_V, RLC_G, SMU = 7, 8, 18
RLC_RESTORE_LIST_GPM_MEM, RLC_RESTORE_LIST_SRM_MEM, RLC_RESTORE_LIST_SRM_CNTL = 20, 21, 22
RLC_P, RLC_IRAM, GLOBAL_TAP_DELAYS, SE0_TAP_DELAYS, SE1_TAP_DELAYS = 25, 26, 27, 28, 29
RLC_DRAM_BOOT, SE2_TAP_DELAYS, SE3_TAP_DELAYS, IMU_I, IMU_D = 48, 65, 66, 68, 69
RS64_PFP, RS64_ME, RS64_MEC = 87, 88, 89
# per RS64 engine: its code's type, then one stack type per pipe (amdgpu loads the file's one
# data section as each: PFP and ME have 2 pipes, MEC 4)
RS64 = {"pfp": (RS64_PFP, 90, 91), "me": (RS64_ME, 92, 93), "mec": (RS64_MEC, 94, 95, 96, 97)}
# what the RLC's autoload (AUTOLOAD_RLC, sent after RLC_G as amdgpu's psp_np_fw_load does for
# autoload ASICs) needs in the TMR to bring up the compute engine keel uses
AUTOLOAD_NEEDS = frozenset({RLC_G, IMU_I, IMU_D, RS64_MEC, 94})


def frame(cmd: int, fence: int, value: int) -> bytes:
    return FRAME.pack(cmd & 0xFFFFFFFF, cmd >> 32, CMD_BYTES, fence & 0xFFFFFFFF, fence >> 32,
                      value).ljust(FRAME_BYTES, b"\0")


def command(cmd_id: int, body: bytes) -> bytes:
    return (HEAD.pack(CMD_BYTES, BUF_VERSION, cmd_id, 0, 0, 0, 0) + body).ljust(CMD_BYTES, b"\0")
