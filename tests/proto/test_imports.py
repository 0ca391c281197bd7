from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("fabricd", "worker", "scheduler", "libp2p", "torch", "ray", "pickle")


def test_proto_imports_none_of_the_other_packages() -> None:
    code = (
        "import sys\n"
        "import proto, proto.ids, proto.errors, proto.codec, proto.messages, proto.stream, "
        "proto.bridge, proto.certs\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
