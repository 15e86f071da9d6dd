"""Issue 42: does a CUDA-graph capture fail during `eval passkey`? Runs the passkey grid on the bundled teacher and an
untrained Lizard conversion in one process, counting StudentDecoder captures (usage: LENGTHS, e.g. 1024,32768)."""
import sys, warnings, random, torch, linearize
from linearize.eval.passkey import run_passkey
from linearize.models.checkpoint import save
warnings.simplefilter("always")
model, tok = linearize.load_teacher("smollm2-135m")
linearize.convert(model, "lizard")
save(model, "/tmp/ck_lizard", overwrite=True)
import linearize.models.decode as D
orig = D.StudentDecoder.capture
n = {"ok": 0, "fail": 0}
def cap(self):
    try:
        orig(self); n["ok"] += 1
    except Exception as e:
        n["fail"] += 1; print("CAPTURE FAILED:", type(e).__name__, str(e)[:500], flush=True); raise
D.StudentDecoder.capture = cap
res = run_passkey(["smollm2-135m", "/tmp/ck_lizard"], "/tmp/pk", lengths=[int(x) for x in sys.argv[1].split(",")], depths=3, samples=1)
print("captures", n)
