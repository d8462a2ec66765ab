"""Time `vllm-gemma-qat inspect` on a full-size E2B checkpoint (~9.3 GB of
tensors, real shapes, sparse files: headers only on disk). Goal: < 1 s.

    ./run python benchmarks/inspect_bench.py [--layout qat|regular|w4a16] [--repeat N]
"""
import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from vllm_gemma_qat.testing import synthetic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="qat", choices=["qat", "regular", "w4a16"])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic.write_header_only(Path(tmp) / "e2b", "e2b", args.layout)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        cli = shutil.which("vllm-gemma-qat")
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            out = subprocess.run([cli, "inspect", str(path)], capture_output=True,
                                 text=True)
            times.append(time.perf_counter() - t)
        verdict = [l for l in out.stdout.splitlines() if l.startswith("verdict")]
        print(f"E2B {args.layout}: {size / 1e9:.2f} GB of shards (sparse)")
        print(verdict[0] if verdict else out.stderr)
        print(f"inspect wall time (whole process), median of {args.repeat}: "
              f"{statistics.median(times):.3f} s (min {min(times):.3f}, "
              f"max {max(times):.3f}); goal < 1 s")


if __name__ == "__main__":
    main()
