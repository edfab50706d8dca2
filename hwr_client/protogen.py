"""Regenerate the Python gRPC stubs from ``proto/hwr/v1/hwr.proto``.

Run ``python -m hwr_client.protogen`` from the repository root after editing
the proto; ``tests/client/test_proto.py`` fails while the committed stubs are stale.
The generated grpc module imports ``hwr_pb2`` as a top-level module; we
rewrite that one line into a package-relative import so the stubs live inside
``hwr_client.core._proto`` without touching ``sys.path``.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto" / "hwr" / "v1"
OUT_DIR = REPO / "hwr_client" / "core" / "_proto"
GENERATED = ("hwr_pb2.py", "hwr_pb2.pyi", "hwr_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    """Writes the generated stubs into ``out_dir``.

    Raises:
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_DIR / "hwr.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR / 'hwr.proto'}")
        grpc_py = pathlib.Path(tmp) / "hwr_pb2_grpc.py"
        text = grpc_py.read_text()
        text = text.replace("import hwr_pb2 as hwr__pb2", "from . import hwr_pb2 as hwr__pb2")
        grpc_py.write_text(text)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copyfile(pathlib.Path(tmp) / name, out_dir / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    generate(args.out)
    print(f"wrote {', '.join(GENERATED)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
