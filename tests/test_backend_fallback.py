"""Without the compiled extension attnkit runs on the reference backend and says so once."""
import json
import os
import subprocess
import sys

SCRIPT = """
import json, attnkit
texts = ["A short text, with a comma.", ("A pair", "of texts.")]
a = attnkit.extract(texts, max_length=16)
b = attnkit.extract(texts, max_length=16)
print(json.dumps({"backend": attnkit.backend_info(), "meta": a.meta["backend"], "same": bool((a.mean == b.mean).all())}))
"""


def test_reference_fallback_is_announced_once():
    env = dict(os.environ, ATTNKIT_NO_EXT="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"backend": "reference", "meta": "reference", "same": True}
    notices = [l for l in proc.stderr.splitlines() if "fused extension not available" in l]
    assert len(notices) == 1 and "ATTNKIT_NO_EXT" in notices[0] and "reference backend" in notices[0]


def test_an_op_the_built_extension_does_not_define_has_no_kernel():
    """An extension built before an op existed (attnkit::fused_attention_lse, say) must read as 'no kernel', not
    stop `import attnkit` with "operator ... does not exist"."""
    from attnkit import ops

    assert ops._query_kernel("cpu", "attnkit::an_op_no_build_defines") is False
