"""Static throughput of the int8-activation row kernels (AVX2 in ggml_kernels.c, AVX-512 VNNI in ggml_vnni.c) per
CPU model, from llvm-mca: cycles per weight block and activation row, for each row count R the kernels are
instantiated with. A model, not a timing: it ignores memory (one-row products are near memory-bound) and threading;
on a CPU that can run the kernels, ``python -m dyntree_core.bench kernels`` measures them.

    python scripts/mca_row_kernels.py [--cpus icelake-server sapphirerapids znver3] [--json out.json]

Needs gcc (the project's compiler flags) and llvm-mca (Debian: llvm-14). Copies the C files to a temporary folder,
marks each kernel's per-block loop body as an llvm-mca region, compiles to assembly and runs llvm-mca. A region
whose loop over the block's chunks the compiler did not unroll (AVX2 Q4_K at 7 and 8 rows) is left out: llvm-mca
reads straight-line code only.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

QUANT = Path(__file__).resolve().parent.parent / "dyntree_core" / "quant"
BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-std=c11"]
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
BEGIN = '__asm__ volatile("# LLVM-MCA-BEGIN {}" ::: "memory");'
END = '__asm__ volatile("# LLVM-MCA-END {}" ::: "memory");'

#: (file, kernel function, first line of its block loop body, last statement of that body, the instruction
#: counted to tell R, that instruction's count per row and block)
KERNELS = (
    ("ggml_kernels.c", "q4k_q8_rows", "        const uint8_t *blk = wr + b * 144;",
     "                             &mins_acc[r]);\n",
     "vpmaddubsw", 8, "avx2 Q4_K"),
    ("ggml_kernels.c", "q6k_q8_rows", "        const uint8_t *blk = wr + b * 210;",
     "            tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d * d8[r * (K / 256) + b]), tot[r]);\n",
     "vpmaddubsw", 8, "avx2 Q6_K"),
    ("ggml_vnni.c", "q4k_vnni", "        const uint8_t *blk = wr + b * 144;",
     "&mins_acc[r]);\n        }\n",
     "vpdpwssd", 4, "vnni Q4_K"),
    ("ggml_vnni.c", "q6k_vnni", "        const uint8_t *blk = wr + b * 210;",
     "            tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(d * d8[r * (K / 256) + b]), tot[r]);\n        }\n",
     "vpdpwssd", 4, "vnni Q6_K"),
)


def mark(src: str, fn: str, first: str, last: str, tag: str) -> str:
    i = src.index(f"ROWS_KERNEL void {fn}(")
    j = src.index(first, i)
    src = src[:j] + "        " + BEGIN.format(tag) + "\n" + src[j:]
    k = src.index(last, j) + len(last)
    return src[:k] + "        " + END.format(tag) + "\n" + src[k:]


def regions(asm: str, kernels) -> tuple[str, dict[str, tuple[str, int]]]:
    """The assembly with each region renamed uniquely, and name -> (kernel label, R)."""
    out, seen, info, cur, body = [], {}, {}, None, []
    by_tag = {f"k{i}": k for i, k in enumerate(kernels)}
    for line in asm.split("\n"):
        m = re.search(r"# LLVM-MCA-BEGIN (\w+)", line)
        if m:
            seen[m.group(1)] = seen.get(m.group(1), 0) + 1
            cur, body = f"{m.group(1)}_{seen[m.group(1)]}", []
            line = line.replace(m.group(1), cur)
        else:
            m = re.search(r"# LLVM-MCA-END (\w+)", line)
            if m and cur:
                k = by_tag[cur.rsplit("_", 1)[0]]
                count = sum(k[4] in b for b in body)
                unrolled = count % k[5] == 0 and not any(re.match(r"^\.L\w+:", b) for b in body)
                info[cur] = (k[6], count // k[5] if unrolled else 0)
                line, cur = line.replace(m.group(1), cur), None
            elif cur:
                body.append(line)
        out.append(line)
    return "\n".join(out), info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", nargs="+", default=["icelake-server", "sapphirerapids", "znver3"])
    ap.add_argument("--mca", default=shutil.which("llvm-mca") or shutil.which("llvm-mca-14"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.mca:
        print("llvm-mca not found (Debian: apt-get install llvm-14)", file=sys.stderr)
        return 2
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for f in QUANT.glob("*.[ch]"):
            shutil.copy(f, tmp / f.name)
        asm_files = []
        for name, flags in (("ggml_kernels.c", []), ("ggml_vnni.c", VNNI_FLAGS)):
            src = (tmp / name).read_text()
            for i, k in enumerate(KERNELS):
                if k[0] == name:
                    src = mark(src, k[1], k[2], k[3], f"k{i}")
            (tmp / name).write_text(src)
            asm = tmp / (name + ".s")
            subprocess.run(["gcc", *BASE_FLAGS, *flags, "-S", str(tmp / name), "-o", str(asm)], check=True)
            text, info = regions(asm.read_text(), KERNELS)
            asm.write_text(text)
            asm_files.append((asm, info))
        for cpu in args.cpus:
            results[cpu] = {}
            for asm, info in asm_files:
                p = subprocess.run([args.mca, f"-mcpu={cpu}", "-iterations=100", str(asm)], capture_output=True,
                                   text=True)
                if p.returncode:
                    print(f"{cpu}: llvm-mca cannot model {asm.name} ({p.stderr.strip().splitlines()[0][:120]}; no AVX-512 on that CPU?)", file=sys.stderr)
                    continue
                for m in re.finditer(r"Code Region - (\w+).*?Block RThroughput:\s+([\d.]+)", p.stdout, re.S):
                    label, r = info[m.group(1)]
                    if r:
                        results[cpu].setdefault(label, {})[str(r)] = float(m.group(2)) / r
    for cpu, kernels in results.items():
        print(f"\n{cpu}: llvm-mca cycles per 256-weight block and activation row")
        rs = sorted({int(r) for v in kernels.values() for r in v})
        print("| kernel | " + " | ".join(f"R={r}" for r in rs) + " |")
        print("|---" * (len(rs) + 1) + "|")
        for label in sorted(kernels):
            print(f"| {label} | " + " | ".join(f"{kernels[label][str(r)]:.1f}" if str(r) in kernels[label] else "—"
                                                for r in rs) + " |")
    if args.json:
        args.json.write_text(json.dumps({"llvm_mca": args.mca, "cycles_per_block_row": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
