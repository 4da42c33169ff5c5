"""Regenerate the KGSL facts in tests/test_qcom_uapi.py from a copy of the real header.

    python tests/qcom_uapi_regen.py path/to/msm_kgsl.h

Compiles tests/qcom_uapi_probe.c against that header for aarch64 (the comma 3X) and x86-64 (the
host that runs the mock), reads the facts back out of each object file, checks both agree, and
prints them as the Python dict the test records. Needs clang-19, llvm-objcopy-19 and the host's
kernel headers. For aarch64 the probe gets arm64's asm/ headers, which (for what msm_kgsl.h uses)
are only includes of asm-generic: written out here rather than borrowing x86's, whose
posix_types.h would give a 32-bit size_t to a non-x86 target.
"""
import os
import shutil
import subprocess
import sys
import tempfile

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qcom_uapi_probe.c")
TARGETS = ("aarch64-linux-gnu", "x86_64-linux-gnu")
ARM64_ASM = {"types.h": "asm-generic/int-ll64.h", "posix_types.h": "asm-generic/posix_types.h",
             "ioctl.h": "asm-generic/ioctl.h", "bitsperlong.h": "asm-generic/bitsperlong.h"}


def asm_dir(tmp: str, target: str) -> str:
    if target.startswith("x86_64"):
        return "/usr/include/x86_64-linux-gnu"
    os.makedirs(os.path.join(tmp, "arm64", "asm"))
    for name, generic in ARM64_ASM.items():
        with open(os.path.join(tmp, "arm64", "asm", name), "w") as f:
            extra = "#define __BITS_PER_LONG 64\n" if name == "bitsperlong.h" else ""
            f.write(f"{extra}#include <{generic}>\n")
    return os.path.join(tmp, "arm64")


def facts(header: str, target: str, probe: str = PROBE, name: str = "msm_kgsl.h") -> dict:
    """The facts `probe` records from `header`, included by the probe as linux/`name`."""
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "linux"))
        shutil.copy(header, os.path.join(tmp, "linux", name))
        obj = os.path.join(tmp, "probe.o")
        subprocess.run(["clang-19", f"--target={target}", "-D__user=", "-I", tmp, "-isystem",
                        asm_dir(tmp, target), "-c", probe, "-o", obj], check=True)
        names, values = os.path.join(tmp, "n"), os.path.join(tmp, "v")
        subprocess.run(["llvm-objcopy-19", f"--dump-section=.keel_names={names}",
                        f"--dump-section=.keel_facts={values}", obj], check=True)
        keys = open(names, "rb").read().rstrip(b"\0").decode().split("\n")[:-1]
        raw = open(values, "rb").read()
        nums = [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]
    assert len(keys) == len(nums), (len(keys), len(nums))
    return dict(zip(keys, nums))


def main(header: str) -> None:
    found = [facts(header, t) for t in TARGETS]
    if found[0] != found[1]:
        diff = {k: (v, found[1].get(k)) for k, v in found[0].items() if v != found[1].get(k)}
        sys.exit(f"aarch64 and x86-64 disagree: {diff}")
    print("FACTS = {")
    for k, v in found[0].items():
        print(f"    {k!r}: {v:#x}," if v > 255 else f"    {k!r}: {v},")
    print("}")


if __name__ == "__main__":
    main(sys.argv[1])
