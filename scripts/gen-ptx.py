#!/usr/bin/env python3
"""Compiles src/cuda/kernels.cu to PTX with NVRTC, one file per target:
src/cuda/kernels.sm80.ptx (compute_80: A100 and later, H100/H200 included,
through the driver's JIT) and src/cuda/kernels.sm90.ptx (compute_90).

NVRTC comes from pip's nvidia-cuda-nvrtc-cu12, pinned to 12.0.76: PTX from
NVRTC 12.0 (ISA 8.0) loads on every driver from CUDA 12.0 on, newer NVRTCs
emit ISA versions older drivers reject. The machine running oxccl needs only
the NVIDIA driver: it JIT-compiles the embedded PTX.

    python3 scripts/gen-ptx.py                # regenerate (installs NVRTC into target/ if missing)
    python3 scripts/gen-ptx.py --check        # fail if the committed PTX differs (CI)
    python3 scripts/gen-ptx.py --nvrtc PATH   # use this libnvrtc.so.12
"""
import argparse
import ctypes
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "src", "cuda", "kernels.cu")
TARGETS = {"sm80": "compute_80", "sm90": "compute_90"}
NVRTC_PIN = "nvidia-cuda-nvrtc-cu12==12.0.76"
NVRTC_DIR = os.path.join(ROOT, "target", "nvrtc-pip")
# No fast math: the kernels must round exactly as the host does.
OPTIONS = ["--std=c++14", "-default-device", "--fmad=false"]


def find_nvrtc(explicit):
    if explicit:
        return explicit
    found = glob.glob(os.path.join(NVRTC_DIR, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"))
    if not found:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet",
                               "--disable-pip-version-check", "--no-deps",
                               "--target", NVRTC_DIR, NVRTC_PIN])
        found = glob.glob(os.path.join(NVRTC_DIR, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"))
    if not found:
        sys.exit(f"gen-ptx: no libnvrtc.so.12 under {NVRTC_DIR} after installing {NVRTC_PIN}")
    return found[0]


def compile_ptx(nvrtc, source, arch):
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(
        f"gen-ptx: {what} failed: {nvrtc.nvrtcGetErrorString(rc).decode()}")
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernels.cu",
                                   0, None, None), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in OPTIONS]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"gen-ptx: compiling for {arch} failed:\n{log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed PTX instead of writing")
    parser.add_argument("--nvrtc", help="path of libnvrtc.so.12")
    args = parser.parse_args()
    nvrtc = ctypes.CDLL(find_nvrtc(args.nvrtc))
    version = (ctypes.c_int(), ctypes.c_int())
    nvrtc.nvrtcVersion(ctypes.byref(version[0]), ctypes.byref(version[1]))
    source = open(SOURCE).read()
    stale = []
    for name, arch in TARGETS.items():
        ptx = compile_ptx(nvrtc, source, arch)
        path = os.path.join(ROOT, "src", "cuda", f"kernels.{name}.ptx")
        if args.check:
            committed = open(path).read() if os.path.exists(path) else ""
            if committed != ptx:
                stale.append(path)
        else:
            with open(path, "w") as f:
                f.write(ptx)
            print(f"gen-ptx: {path} ({len(ptx)} bytes, {arch}, NVRTC {version[0].value}.{version[1].value})")
    if stale:
        sys.exit("gen-ptx: the committed PTX differs from what kernels.cu compiles to: "
                 + ", ".join(stale) + "\nrun `python3 scripts/gen-ptx.py` and commit the result")
    if args.check:
        print(f"gen-ptx: committed PTX matches kernels.cu (NVRTC {version[0].value}.{version[1].value})")


if __name__ == "__main__":
    main()
