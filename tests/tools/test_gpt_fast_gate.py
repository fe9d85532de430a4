"""Tests of gpt_fast_bench.py's Gate (bench/tools), the rule that lets the gpt-fast baseline
compile several single-case processes side by side (bench/tools/baselines.sh with GF_PARALLEL) and
still time each alone: no timed section may start before every process of the batch has
compiled (or exited), and no two timed sections may overlap. Real processes, real files and
locks; each "compile" is a sleep and each timed section writes its start and end times.

  python3 -m pytest -q tests/tools/test_gpt_fast_gate.py   (or python3 the file itself)
"""
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "bench", "tools")

# One case process: "compiles" for `delay` seconds, then either fails (exit 1, never timing) or
# times a section of `hold` seconds behind the gate, appending "start end" to `log`.
CASE = r"""
import sys, time
import gpt_fast_bench as g
gate_dir, count, delay, hold, fail, log, timeout = sys.argv[1:8]
gate = g.Gate(gate_dir, int(count), float(timeout))
time.sleep(float(delay))
with open(log + ".ready", "a") as f:
    f.write(f"{time.time()}\n")
if fail == "1":
    sys.exit(1)
gate.enter()
start = time.time()
time.sleep(float(hold))
end = time.time()
gate.leave()
with open(log, "a") as f:
    f.write(f"{start} {end}\n")
"""


def run_cases(cases, count, timeout_s=30.0, hold=0.3):
    """cases: [(compile delay s, fails)]; returns (ready times, [(start, end)] of timed
    sections, exit codes)."""
    with tempfile.TemporaryDirectory() as tmp:
        gate_dir, log = os.path.join(tmp, "gate"), os.path.join(tmp, "timed")
        env = dict(os.environ, PYTHONPATH=BENCH, PYTHONDONTWRITEBYTECODE="1")
        procs = [subprocess.Popen([sys.executable, "-c", CASE, gate_dir, str(count), str(d),
                                   str(hold), "1" if fails else "0", log, str(timeout_s)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for d, fails in cases]
        codes = [p.wait(timeout=60) for p in procs]
        ready = [float(x) for x in open(log + ".ready").read().split()]
        timed = []
        if os.path.exists(log):
            timed = [tuple(map(float, line.split())) for line in open(log) if line.strip()]
        return ready, sorted(timed), codes


def test_timed_sections_wait_for_every_compile_and_never_overlap():
    # The slowest "compile" is the failing one: its exit must still release the others.
    ready, timed, codes = run_cases([(0.2, False), (0.6, False), (1.0, False), (1.5, True)],
                                    count=4)
    assert codes == [0, 0, 0, 1]
    assert len(timed) == 3
    last_ready = max(ready)
    for start, _ in timed:
        assert start >= last_ready - 0.05, (start, last_ready)
    for (_, end), (start, _) in zip(timed, timed[1:]):
        assert start >= end - 0.01, timed


def test_a_missing_process_delays_the_others_only_until_the_timeout():
    # Three expected, two started: both time after the 2 s timeout, one at a time.
    t0 = time.time()
    ready, timed, codes = run_cases([(0.1, False), (0.1, False)], count=3, timeout_s=2.0)
    assert codes == [0, 0]
    assert len(timed) == 2
    assert timed[0][0] >= t0 + 2.0
    assert timed[1][0] >= timed[0][1] - 0.01


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
            print("ok", name)
