"""Waits that must end and inputs that must be refused: a checkpoint_fn
that never returns fails barrier() by the write deadline and the
interpreter still exits; Ctrl-C during a wait on a stalled save, a load
or a create_global_plan raises KeyboardInterrupt at once; a tensor's storage swapped under a pending save
cannot crash it; NUL characters in keys and crafted tree positions are
refused, naming the key.

Run by ctest (exit 77 = skipped when torch is not importable)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import _support  # noqa: F401 (exits 77, skipped, without torch)
import torch  # noqa: E402

import ferry
from ferry import _tree


class Base(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="ferry_py_hangs_")

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def interrupt(self, code, faults, ready="CALLING"):
        """Runs `code` (which prints `ready`, then blocks in a call held by
        the stall in `faults`), sends SIGINT once the stall holds it, and
        checks KeyboardInterrupt came within 2 s. Returns the child's stderr."""
        env = dict(os.environ)
        # The stalled call never returns: exit leaves it behind after 1 s.
        env.update({"FERRY_FAULTS": faults, "FERRY_EXIT_WAIT_S": "1"})
        proc = subprocess.Popen([sys.executable, "-c", code, self.root], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            self.assertEqual(proc.stdout.readline().strip(), ready)
            # Sent once the call is held in storage: a signal before it
            # would interrupt the Python around the call, not the call.
            before = []
            while True:
                line = proc.stderr.readline()
                before.append(line)
                self.assertTrue(line, "".join(before))
                if "stalled until released" in line:
                    break
            sent = time.monotonic()  # CLOCK_MONOTONIC: the child's clock too
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        words = out.split()
        self.assertEqual(words[:1], ["INTERRUPTED"], out + err)
        self.assertLess(float(words[1]) - sent, 2.0)
        self.assertIn("KeyboardInterrupt", err)
        self.assertNotEqual(proc.returncode, 0)
        return err


class StuckWriters(Base):
    def test_stuck_checkpoint_fn_fails_barrier_and_the_interpreter_exits(self):
        code = (
            "import sys, threading, time, torch, ferry\n"
            "rt = ferry.Runtime({'write_timeout': '1s', 'pool_bytes': '4MiB',\n"
            "                    'chunk_bytes': '1MiB'}, rank=0, world_size=1)\n"
            "def stuck(sd, filename):\n"
            "    threading.Event().wait()\n"
            "p = ferry.SavePlanner({'w': torch.ones(16)}, checkpoint_fn=stuck, root=sys.argv[1],\n"
            "                      step=1, runtime=rt)\n"
            "plans = p.create_global_plan()\n"
            "p.save_on_this_process(plans[rt.rank])\n"
            "t0 = time.monotonic()\n"
            "try:\n"
            "    p.barrier()\n"
            "    print('COMMITTED')\n"
            "except ferry.FerryError as e:\n"
            "    print('FAILED %.1f %s: %s' % (time.monotonic() - t0, e.code, e), flush=True)\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", code, self.root], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            failed_at = time.monotonic()
            out, err = proc.communicate(timeout=90)
            exiting = time.monotonic() - failed_at
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.assertEqual(proc.returncode, 0, line + out + err)
        self.assertTrue(line.startswith("FAILED "), line + err)
        seconds = float(line.split()[1])
        self.assertLess(seconds, 15, line)  # write-timeout 1 s + the drain's grace + verdict
        self.assertIn(" timeout: ", line)
        # Rank 0's phase deadline or the rank's abandonment may speak first.
        self.assertIn("write phase", line)
        self.assertIn("rank 0", line)
        self.assertIn("checkpoint_fn writing", line)
        self.assertIn("rank-00000-0000.safetensors", line)
        # Exit waited a bounded time for the stuck thread, then left it.
        self.assertLess(exiting, 20, err)
        self.assertIn("still stuck", err)
        self.assertEqual(ferry.list_steps(self.root), [])

    def test_ctrl_c_interrupts_a_wait_on_a_stalled_save(self):
        code = (
            "import sys, time, torch, ferry\n"
            "ferry.configure(pool_bytes='4MiB', chunk_bytes='1MiB')\n"
            "h = ferry.save_async({'w': torch.ones(1 << 20)}, sys.argv[1], 1)\n"
            "try:\n"
            "    print('WAITING', flush=True)\n"
            "    h.wait()\n"
            "    print('RETURNED', flush=True)\n"
            "except KeyboardInterrupt:\n"
            "    print('INTERRUPTED %.6f' % time.monotonic(), flush=True)\n"
            "    raise\n"
        )
        # The first pwrite of a data file never returns; exit leaves the save after 1 s.
        self.interrupt(code, "stall:write:1:path=.safetensors", ready="WAITING")


class InterruptedCalls(Base):
    """Ctrl-C during a load or a create_global_plan held open by a stalled
    storage call raises KeyboardInterrupt at once, not when the call ends."""

    def test_ctrl_c_interrupts_a_load_on_stalled_reads(self):
        ferry.save({"w": torch.ones(1 << 20)}, self.root, 1)
        code = (
            "import sys, time, torch, ferry\n"
            "rt = ferry.Runtime({'pool_bytes': '4MiB', 'chunk_bytes': '1MiB'},\n"
            "                   rank=0, world_size=1)\n"
            "out = {'w': torch.zeros(1 << 20)}\n"
            "try:\n"
            "    print('CALLING', flush=True)\n"
            "    rt.load(out, sys.argv[1])\n"
            "    print('RETURNED', flush=True)\n"
            "except KeyboardInterrupt:\n"
            "    print('INTERRUPTED %.6f' % time.monotonic(), flush=True)\n"
            "    raise\n"
        )
        err = self.interrupt(code, "stall:read:1:path=.safetensors")
        # Exit left the load's thread (it still held the tensor) after 1 s.
        self.assertIn("still running", err)

    def test_ctrl_c_interrupts_create_global_plan(self):
        # The plan's answer waits for rank 0 to make the pending directory;
        # exit waits for the save's plan-timeout.
        code = (
            "import sys, time, torch, ferry\n"
            "rt = ferry.Runtime({'pool_bytes': '4MiB', 'chunk_bytes': '1MiB',\n"
            "                    'plan_timeout': '2s'}, rank=0, world_size=1)\n"
            "p = ferry.SavePlanner({'w': torch.ones(16)}, root=sys.argv[1], step=1, runtime=rt)\n"
            "try:\n"
            "    print('CALLING', flush=True)\n"
            "    p.create_global_plan()\n"
            "    print('RETURNED', flush=True)\n"
            "except KeyboardInterrupt:\n"
            "    print('INTERRUPTED %.6f' % time.monotonic(), flush=True)\n"
            "    raise\n"
        )
        self.interrupt(code, "stall:mkdir:1:path=.pending-")


class PendingSave(Base):
    def test_storage_swapped_under_a_pending_save(self):
        # A pool of 2 blocks for 64 MiB: the snapshot streams for as long as
        # the writes take, long after t.set_() dropped the tensor's storage.
        rt = ferry.Runtime({"pool_bytes": "2MiB", "chunk_bytes": "1MiB"}, rank=0, world_size=1)
        try:
            t = torch.arange(1 << 24, dtype=torch.float32)
            want = t.clone()
            h = rt.save_async({"w": t}, self.root, 1)
            t.set_(torch.zeros(4))
            # Memory freed now would be unmapped or reused by these.
            junk = [torch.full((1 << 22,), 7.0) for _ in range(8)]
            h.wait()
            del junk
            out = {"w": torch.zeros(1 << 24)}
            rt.load(out, self.root)
            self.assertTrue(torch.equal(out["w"], want))
        finally:
            rt.close()


class RefusedInput(Base):
    def test_nul_in_a_key_is_refused(self):
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.save({"a\0b": torch.ones(2)}, self.root, 1)
        self.assertIn("'a\\x00b'", str(cm.exception))
        self.assertIn("NUL", str(cm.exception))
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.save({"outer": {"x\0": torch.ones(2)}}, self.root, 1)
        self.assertIn("outer.x", str(cm.exception))
        with self.assertRaises(ferry.FerryError) as cm:
            ferry.save({"w": torch.ones(2)}, self.root, 1, metadata={"note": "a\0b"})
        self.assertIn("'note'", str(cm.exception))
        self.assertEqual(ferry.list_steps(self.root), [])

    def test_crafted_tree_position_is_bounded(self):
        t0 = time.monotonic()
        for pos in (30000000, 3e7, -1, True, "3"):
            with self.assertRaises(ferry.FerryError) as cm:
                _tree.build({"a.0": 1}, {"a.0": ["a", [pos]]})
            self.assertIn("'a.0'", str(cm.exception))
            self.assertIn("list position", str(cm.exception))
        self.assertLess(time.monotonic() - t0, 1.0)
        with self.assertRaises(ferry.FerryError):
            _tree.build({"a": 1, "a.b": 2}, {"a": ["a"], "a.b": ["a", "b"]})
        # Saved trees still rebuild: positions below the number of entries.
        self.assertEqual(_tree.build({"l.0": 1, "l.1": 2}, {"l.0": ["l", [0]], "l.1": ["l", [1]]}),
                         {"l": [1, 2]})


if __name__ == "__main__":
    unittest.main(verbosity=2)
