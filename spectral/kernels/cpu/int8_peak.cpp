// The integer path's roofline: how many int8 multiply-adds a second this CPU's threads can do
// with the one instruction the tiles are built on (int8_dot.h's DotSum::add: vpmaddubsw and
// vpaddw on AVX2, vpdpbusd with VNNI), when nothing else is in the way. bench/int8_roofline.py
// sets each tile's rate against it. Part of module.cpp's one translation unit.
#include <chrono>
#include <cstdint>
#include <vector>

#include "int8_dot.h"

namespace {

// Independent accumulators per thread: enough that each add waits on no other (the add's
// latency times the adds the CPU issues a cycle), few enough to stay in AVX2's 16 registers.
constexpr int kPeakChains = 12;
// Adds between two looks at the clock.
constexpr int64_t kPeakRounds = 4096;

#if defined(SPECTRAL_VEC)
// kPeakRounds products of u and s added to each accumulator. The sums are copied in and out so
// that they stay in registers within (across the caller's calls to the clock they cannot), and
// each is held in its register as it is added to (as the tiles' `settle` does).
inline void peak_rounds(DotSum (&sums)[kPeakChains], IVec u, IVec s) {
  DotSum acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = sums[c];
  for (int64_t i = 0; i < kPeakRounds; ++i) {
    for (int c = 0; c < kPeakChains; ++c) {
      // u and s opaque to the compiler: it may not hoist the products out of the loop, nor
      // share one product between the accumulators.
      asm("" : "+v"(u), "+v"(s));
      acc[c].add(u, s);
      asm("" : "+v"(acc[c].v));
    }
  }
  for (int c = 0; c < kPeakChains; ++c) sums[c] = acc[c];
}

// Multiply-adds a second of one thread for about `seconds`; `sink` keeps the sums alive.
double peak_thread(double seconds, int32_t* sink) {
  using clock = std::chrono::steady_clock;
  DotSum acc[kPeakChains];
  int64_t rounds = 0;
  const auto start = clock::now();
  double elapsed = 0;
  do {
    peak_rounds(acc, iv::bytes(3), iv::bytes(-5));
    rounds += kPeakRounds;
    elapsed = std::chrono::duration<double>(clock::now() - start).count();
  } while (elapsed < seconds);
  IVec total = acc[0].widen();
  for (int c = 1; c < kPeakChains; ++c) total = iv::add32(total, acc[c].widen());
  *sink = iv::first_lane(total);
  return static_cast<double>(rounds) * kPeakChains * 4 * kIntLanes / elapsed;  // an add's products
}
#endif

}  // namespace

// int8 multiply-adds a second of all torch's threads at once, each running DotSum::add on
// independent accumulators for about `seconds`; 0 in a build without vectors (scalar loops),
// which has no such instruction to measure.
double int8_peak_macs(double seconds) {
  TORCH_CHECK(seconds > 0, "seconds must be > 0 (got ", seconds, ")");
#if defined(SPECTRAL_VEC)
  const int64_t threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  std::vector<int32_t> sinks(threads, 0);
  // One measure a thread (a thread given several indices runs them one after another).
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t) {
    rates[t0] = peak_thread(seconds, &sinks[t0]);
  });
  double total = 0;
  for (int64_t t = 0; t < threads; ++t) total += rates[t];
  return total;
#else
  return 0.0;
#endif
}
