"""Regenerate the Python stubs in tandem/v1/ from protos/ (the one command):

    python -m tandem.protogen

Uses grpcio-tools' bundled protoc, so the output depends only on the grpcio-tools version.
tests/unit/test_protos.py checks that the committed stubs match a fresh generation.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = ("tandem/v1/generate.proto", "tandem/v1/worker.proto")


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under out_dir/tandem/v1."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    package_dir = out_dir / "tandem" / "v1"
    (package_dir / "__init__.py").write_text(
        '"""Generated gRPC stubs (python -m tandem.protogen). Do not edit."""\n')
    return sorted(package_dir.glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT):
        print(path)
