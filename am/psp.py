"""The PSP's GPCOM ring after sOS, from psp_gfx_if.h (torvalds/linux 041e6916) as facts: what the
driver writes and the mock PSP reads, in one place.

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
HEAD = struct.Struct("<7I")  # buf_size, buf_version, cmd_id, resp_buf lo, hi, offset, size
BUF_VERSION = 1
SETUP_TMR, LOAD_IP_FW = 0x5, 0x6  # psp_gfx_cmd_id
UNKNOWN_COMMAND = 0x100  # PSP_ERR_UNKNOWN_COMMAND
# psp_gfx_cmd_setup_tmr: address lo, hi (4 KiB aligned), size (multiple of 4 KiB), flags,
# system address lo, hi; psp_gfx_cmd_load_ip_fw: address lo, hi (4 KiB aligned), size, fw_type
SETUP = struct.Struct("<6I")
LOAD = struct.Struct("<4I")
# psp_gfx_fw_type for the files gc 11 loads through LOAD_IP_FW (RS64 types: the SOC21 ones)
RLC_G, RS64_MEC = 8, 89
FW_TYPES = {"gc_{v}_rlc": RLC_G, "gc_{v}_mec": RS64_MEC}
TMR_BYTES = 4 << 20  # amdgpu's PSP_TMR_SIZE for a discrete card (1 MiB aligned)


def frame(cmd: int, fence: int, value: int) -> bytes:
    return FRAME.pack(cmd & 0xFFFFFFFF, cmd >> 32, CMD_BYTES, fence & 0xFFFFFFFF, fence >> 32,
                      value).ljust(FRAME_BYTES, b"\0")


def command(cmd_id: int, body: bytes) -> bytes:
    return (HEAD.pack(CMD_BYTES, BUF_VERSION, cmd_id, 0, 0, 0, 0) + body).ljust(CMD_BYTES, b"\0")
