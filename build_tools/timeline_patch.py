"""Per-block clock64 stamps in the sm_90a prefill (16-bit; the fp8 row's consumers too), for a
throwaway copy of the tree.

    mkdir /tmp/tl && git archive HEAD | tar -x -C /tmp/tl && python build_tools/timeline_patch.py /tmp/tl
    (cd /tmp/tl && make ARCHS=sm_90a && PYTHONPATH=$PWD python3 build_tools/timeline_run.py)

Consumer warpgroup c's thread 0 stamps, for each of its CTA's first 16 blocks (Sm90Walk.q_round),
events c * 16 + 0 .. 6: block entry, Q landed, first turn taken, first S done, tile loop done, last
P V done, epilogue done (+ 7: the block's tile count; + 15: ahead() done, between the last P V and
the epilogue), and + 8 .. 14 the cycles its tile loop spent
(clock, summed over the block's tiles after the first) waiting for K (k_full), for V (v_full), for
its turn, for S (wgmma wait 1) and for P V (wgmma wait 0), holding its turn (issuing the two GEMMs)
and between the S and P V waits (the softmax); the producer's thread 0 (TMA rows), events 32 .. 37
of the block: its walk's top (before the index fetch), the index known, the work decoded (run()
entered), Q free, Q's loads issued, its tile loop done; thread 0 / the first consumer thread
stamp the CTA's start and end (globaltimer and clock64). The stamps live in the cubins' pfa_tl / pfa_tl_cta
globals (extern "C"), which timeline_run.py reads through the loaded libraries. Cycle counts move
with the SM clock (a memory wait is fixed in ns): compare builds at the same clock.
The patch asserts every anchor it edits, so a source change that moves one fails loudly here.
"""
import sys, pathlib
root = pathlib.Path(sys.argv[1]) / "kernel_src/include/pfa/attention"

def sub(path, old, new, count=1):
    p = root / path
    t = p.read_text()
    assert t.count(old) == count, (path, old, t.count(old))
    p.write_text(t.replace(old, new))

HDR = r'''
#define PFA_TIMELINE 1
extern "C" {
__device__ unsigned long long pfa_tl[1024 * 16 * 48];
__device__ unsigned long long pfa_tl_cta[1024 * 4];
}
#define PFA_TL(k, e) do { if ((threadIdx.x % 128) == 0 && (k) < 16) \
  ::pfa_tl[(blockIdx.x * 16 + (k)) * 48 + (e)] = clock64(); } while (0)
#define PFA_TLV(k, e, v) do { if ((threadIdx.x % 128) == 0 && (k) < 16) \
  ::pfa_tl[(blockIdx.x * 16 + (k)) * 48 + (e)] = (v); } while (0)
#define PFA_TLW(i, stmt) do { const unsigned _t0 = clock(); stmt; _tlw[i] += clock() - _t0; } while (0)
'''
sub("sm90/pipeline.cuh", "#include <stdint.h>\n", "#include <stdint.h>\n" + HDR)

def gt():
    return "({unsigned long long _g; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(_g)); _g;})"

# CTA start / end
sub("sm90/cta.cuh", "  ptx::allow_dependents();\n  ptx::wait_prior_grids();\n",
    "  if (threadIdx.x == 0) { ::pfa_tl_cta[blockIdx.x * 4] = " + gt() + "; ::pfa_tl_cta[blockIdx.x * 4 + 1] = clock64(); }\n"
    "  ptx::allow_dependents();\n  ptx::wait_prior_grids();\n")
# (both persistent consumer walks: decode-ahead, and the plain one the contiguous fp8 rows take)
CTA_END = ("      if (tid == Cfg::WG_THREADS) { ::pfa_tl_cta[blockIdx.x * 4 + 2] = " + gt() +
           "; ::pfa_tl_cta[blockIdx.x * 4 + 3] = clock64(); }\n")
sub("sm90/cta.cuh", "      walk_done(wg - 1, walk);\n    }\n  }\n}\n",
    "      walk_done(wg - 1, walk);\n" + CTA_END + "    }\n  }\n}\n")
sub("sm90/cta.cuh", "      walk_done(wg - 1, walk);\n    } else {\n",
    "      walk_done(wg - 1, walk);\n" + CTA_END + "    } else {\n")
# consumer: entry / epilogue end, in an entry header's consume (prefill_sm90.cuh, prefill_sm90_fp8.cuh)
import re

def stamp_consume(header, epilogue_cfg):
    pf = root / header
    src = pf.read_text()
    a = "    Consumer::mainloop(p, w, rows, base, wg, lane, o, m, l, walk);\n"
    assert src.count(a) == 1, (header, a)
    src = src.replace(a, "    PFA_TL(walk.q_round, wg * 16 + 0);\n    PFA_TLV(walk.q_round, wg * 16 + 7, w.num_tiles);\n" + a +
                      "    PFA_TL(walk.q_round, wg * 16 + 5);\n")
    b = "    ahead();\n"  # (+ 15) the next block taken (DECODE_AHEAD: its decode) before the epilogue
    assert src.count(b) == 1, (header, b)
    src = src.replace(b, b + "    PFA_TL(walk.q_round, wg * 16 + 15);\n")
    m = re.search(r"    EpilogueSm90<" + epilogue_cfg + r", Consumer::O_ACC[^>]*>::run\([^;]*\);\n", src)
    assert m, (header, "EpilogueSm90<...>::run")
    src = src[:m.end()] + "    PFA_TL(walk.q_round, wg * 16 + 6);\n" + src[m.end():]
    pf.write_text(src)

stamp_consume("prefill_sm90.cuh", "Cfg")
# consumer mainloop: q ready, turn taken, first S done, loop end
sub("sm90/consumer.cuh", "    ptx::mbar_wait(Cfg::q_full(base), walk.q_round & 1);\n",
    "    ptx::mbar_wait(Cfg::q_full(base), walk.q_round & 1);\n    PFA_TL(walk.q_round, wg * 16 + 1);\n")
sub("sm90/consumer.cuh", "    ptx::mbar_wait(Cfg::k_full(base, st0), walk.phase<STAGES>(0));\n    turn.take();\n",
    "    ptx::mbar_wait(Cfg::k_full(base, st0), walk.phase<STAGES>(0));\n    turn.take();\n    PFA_TL(walk.q_round, wg * 16 + 2);\n")
sub("sm90/consumer.cuh", "    if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st0));\n",
    "    PFA_TL(walk.q_round, wg * 16 + 3);\n    if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st0));\n")
sub("sm90/consumer.cuh", "    const int last = walk.stage<STAGES>(n - 1);\n",
    "    PFA_TL(walk.q_round, wg * 16 + 4);\n"
    "    for (int _i = 0; _i < 7; ++_i) PFA_TLV(walk.q_round, wg * 16 + 8 + _i, _tlw[_i]);\n"
    "    const int last = walk.stage<STAGES>(n - 1);\n")
# the tile loop's waits, summed (32-bit clock: a block's loop stays far below 2^32 cycles)
sub("sm90/consumer.cuh", "    bool pv_prev = true;  // tile it - 1 has a P V to issue\n",
    "    bool pv_prev = true;  // tile it - 1 has a P V to issue\n    unsigned _tlw[7] = {0, 0, 0, 0, 0, 0, 0};\n")
# (V's wait sits before the turn, or inside it between the two GEMMs: RESCALE_IN_TURN)
sub("sm90/consumer.cuh", "      ptx::mbar_wait(Cfg::k_full(base, st), walk.phase<STAGES>(it));\n"
    "      if constexpr (!RESCALE_IN_TURN) ptx::mbar_wait(Cfg::v_full(base, prev), walk.phase<STAGES>(it - 1));\n"
    "      turn.take();\n",
    "      PFA_TLW(0, ptx::mbar_wait(Cfg::k_full(base, st), walk.phase<STAGES>(it)));\n"
    "      if constexpr (!RESCALE_IN_TURN) PFA_TLW(1, ptx::mbar_wait(Cfg::v_full(base, prev), walk.phase<STAGES>(it - 1)));\n"
    "      PFA_TLW(2, turn.take());\n      const unsigned _t5 = clock();\n")
sub("sm90/consumer.cuh", "        rescale_o_if<LAZY_O>(o, corr, moved);\n        ptx::mbar_wait(Cfg::v_full(base, prev), walk.phase<STAGES>(it - 1));\n",
    "        rescale_o_if<LAZY_O>(o, corr, moved);\n        PFA_TLW(1, ptx::mbar_wait(Cfg::v_full(base, prev), walk.phase<STAGES>(it - 1)));\n")
# the turn's hold (the two GEMMs' issue) and the softmax between the S and P V waits
sub("sm90/consumer.cuh", "      turn.pass();\n      ptx::wgmma_wait<1>();",
    "      turn.pass();\n      _tlw[5] += clock() - _t5;\n      ptx::wgmma_wait<1>();")
sub("sm90/consumer.cuh", "      ptx::wgmma_wait<1>();  // S of this tile (groups complete in order); P V still running\n",
    "      PFA_TLW(3, ptx::wgmma_wait<1>());\n      const unsigned _t6 = clock();\n")
sub("sm90/consumer.cuh", "      ptx::wgmma_wait<0>();\n      ptx::wgmma_fence_regs(o);\n",
    "      _tlw[6] += clock() - _t6;\n      PFA_TLW(4, ptx::wgmma_wait<0>());\n      ptx::wgmma_fence_regs(o);\n")
# the producer's thread 0 (events 32 ..): walk top (before the index fetch), index known, run()
# entry (work decoded), Q free, Q's copies issued, tile loop done
sub("sm90/cta.cuh", "        const int b = producer ? Sched::produce(p, base, k, tid) : Sched::consume(base, k);\n",
    "        if (producer) PFA_TL(walk.q_round, 32);\n"
    "        const int b = producer ? Sched::produce(p, base, k, tid) : Sched::consume(base, k);\n"
    "        if (producer) PFA_TL(walk.q_round, 33);\n")
sub("sm90/producer_tma.cuh", "    if (w.num_tiles == 0) return;\n    const int warp = tid / 32, lane = tid % 32;\n",
    "    if (w.num_tiles == 0) return;\n    PFA_TL(walk.q_round, 34);\n    const int warp = tid / 32, lane = tid % 32;\n")
sub("sm90/producer_tma.cuh", "      wait_q_free<Cfg>(base, walk);\n      ProducerSm90<Cfg>::load_q(p, w, base, tid);\n    }\n",
    "      wait_q_free<Cfg>(base, walk);\n      PFA_TL(walk.q_round, 35);\n      ProducerSm90<Cfg>::load_q(p, w, base, tid);\n    }\n"
    "    PFA_TL(walk.q_round, 36);\n")
sub("sm90/producer_tma.cuh", "      if (tma && tail) ++walk.tails;\n    }\n",
    "      if (tma && tail) ++walk.tails;\n    }\n    PFA_TL(walk.q_round, 37);\n")
# the fp8 row (prefill_sm90_fp8.cuh consume, fp8_consumer.cuh's overlapped loop): the consumers'
# block events 0 .. 7 and 15 as above (no wait sums); its TMA producer 32 .. 37 (below)
stamp_consume("prefill_sm90_fp8.cuh", "OutCfg")
sub("sm90/fp8_consumer.cuh", "    ptx::mbar_wait(Cfg::q_full(base), walk.q_round & 1);\n    QFrags qf;\n",
    "    ptx::mbar_wait(Cfg::q_full(base), walk.q_round & 1);\n    PFA_TL(walk.q_round, wg * 16 + 1);\n    QFrags qf;\n")
sub("sm90/fp8_consumer.cuh", "    ptx::mbar_wait(Cfg::k_full(base, st0), walk.phase<STAGES>(0));\n    turn.take();\n",
    "    ptx::mbar_wait(Cfg::k_full(base, st0), walk.phase<STAGES>(0));\n    turn.take();\n    PFA_TL(walk.q_round, wg * 16 + 2);\n")
sub("sm90/fp8_consumer.cuh", "    if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st0));\n    Base::release_q(base, Q_REGS",
    "    PFA_TL(walk.q_round, wg * 16 + 3);\n    if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st0));\n    Base::release_q(base, Q_REGS")
sub("sm90/fp8_consumer.cuh", "    const int last = walk.stage<STAGES>(n - 1);\n",
    "    PFA_TL(walk.q_round, wg * 16 + 4);\n    const int last = walk.stage<STAGES>(n - 1);\n")
# the fp8 TMA producer (fp8_producer.cuh run_tma): events 34 .. 37 as the 16-bit TMA producer's
sub("sm90/fp8_producer.cuh", "    wait_q_free<Cfg>(base, walk);\n    load_q(p, w, base, tid);\n    const int n = w.num_tiles;\n",
    "    PFA_TL(walk.q_round, 34);\n    wait_q_free<Cfg>(base, walk);\n    PFA_TL(walk.q_round, 35);\n"
    "    load_q(p, w, base, tid);\n    PFA_TL(walk.q_round, 36);\n    const int n = w.num_tiles;\n")
sub("sm90/fp8_producer.cuh", "    ptx::cp_async_wait<0>();  // (Q's copies, a copied tail's)\n",
    "    PFA_TL(walk.q_round, 37);\n    ptx::cp_async_wait<0>();  // (Q's copies, a copied tail's)\n")
print("patched", root)
