"""Copy the peers' published RoPE test files into a folder outside the repository's tracked tree
(default ``.peer_tests/``) and record each file's repository, path and commit in
``manifest.json`` there.

Files come out of local git directories of the peers' repositories (``--git PEER=GIT_DIR``, read
with ``git show COMMIT:path``); a file obtained another way (a single file read from an index of
the repository, e.g. vLLM's, whose full repository is large) is written by hand into
``.peer_tests/PEER/PATH`` and entered with ``--record PEER PATH COMMIT``.

    python scripts/peer_suites/fetch.py --git flashinfer=/path/to/flashinfer.git \\
        --git te=/path/to/TransformerEngine.git
    python scripts/peer_suites/fetch.py --record vllm \\
        tests/kernels/core/test_pos_encoding.py 0cf5d8e846c42cb6d75136aedede633a66396ace
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# peer -> (GitHub repository, files). The ``__init__.py`` files make the peer's ``tests`` a
# package where its test files import helpers from it (FlashInfer's rope_reference).
PEER_FILES = {
    "flashinfer": ("flashinfer-ai/flashinfer", [
        "tests/__init__.py",
        "tests/test_helpers/__init__.py",
        "tests/test_helpers/rope_reference.py",
        "tests/attention/__init__.py",
        "tests/attention/test_rope.py",
        "tests/norm/test_fused_qk_rmsnorm_rope.py",
    ]),
    "te": ("NVIDIA/TransformerEngine", [
        "tests/pytorch/test_fused_rope.py",
    ]),
    "vllm": ("vllm-project/vllm", [
        "tests/kernels/core/test_pos_encoding.py",
        "tests/kernels/core/test_rotary_embedding.py",
        "tests/kernels/core/test_fused_qk_norm_rope.py",
        "tests/kernels/core/test_fused_qk_norm_rope_kvcache.py",
    ]),
}

DEFAULT_DEST = Path(__file__).resolve().parents[2] / ".peer_tests"


def load_manifest(dest: Path) -> list[dict]:
    path = dest / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else []


def save_manifest(dest: Path, entries: list[dict]) -> None:
    entries = sorted(entries, key=lambda e: (e["peer"], e["path"]))
    (dest / "manifest.json").write_text(json.dumps(entries, indent=2) + "\n")


def upsert(entries: list[dict], entry: dict) -> None:
    entries[:] = [e for e in entries if (e["peer"], e["path"]) != (entry["peer"], entry["path"])]
    entries.append(entry)


def from_git(peer: str, git_dir: str, rev: str, dest: Path, entries: list[dict]) -> None:
    repo, paths = PEER_FILES[peer]
    commit = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    for path in paths:
        text = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"],
                              check=True, capture_output=True).stdout
        target = dest / peer / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text)
        upsert(entries, {"peer": peer, "repo": repo, "path": path, "commit": commit,
                         "source": "git"})
        print(f"{peer}: {path} @ {commit[:12]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--git", action="append", default=[], metavar="PEER=GIT_DIR",
                        help=f"copy PEER's files out of GIT_DIR; PEER in {sorted(PEER_FILES)}")
    parser.add_argument("--rev", default="HEAD", help="the revision to read (default HEAD)")
    parser.add_argument("--record", nargs=3, action="append", default=[],
                        metavar=("PEER", "PATH", "COMMIT"),
                        help="enter a file already written to DEST/PEER/PATH")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    entries = load_manifest(args.dest)
    for spec in args.git:
        peer, _, git_dir = spec.partition("=")
        if peer not in PEER_FILES or not git_dir:
            parser.error(f"--git takes PEER=GIT_DIR with PEER in {sorted(PEER_FILES)}, "
                         f"got {spec!r}")
        from_git(peer, git_dir, args.rev, args.dest, entries)
    for peer, path, commit in args.record:
        if not (args.dest / peer / path).is_file():
            parser.error(f"--record: {args.dest / peer / path} does not exist")
        upsert(entries, {"peer": peer, "repo": PEER_FILES[peer][0], "path": path,
                         "commit": commit, "source": "index"})
        print(f"{peer}: {path} @ {commit[:12]} (recorded)")
    save_manifest(args.dest, entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
