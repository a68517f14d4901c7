// A small pool of helper threads for the decode kernels, robust to a busy machine.
//
// Why not an OpenMP team: a team's region ends at a barrier that waits for every member, so when
// the OS deschedules one member (another process wants the core: on 2 cores, the router or a
// second worker), the whole step waits for it to come back, at every one of the ~150 regions of
// a decode step (measured: 2-thread steps many times slower than 1-thread ones under load).
// Here the caller and the helpers claim chunks of work from one atomic counter, and the caller
// waits only for chunks a helper already claimed: a helper that is not running when a job is
// posted never delays it (the caller does its share too).
#pragma once
#include <cstdint>

namespace pds_cpu {

// fn(ctx, c) for every c in [0, chunks), on the caller and up to `threads - 1` helpers. Returns
// when all are done. Calls from several threads at once are safe (a second caller runs its job
// alone). fn must not call parallel_chunks itself.
void parallel_chunks(int64_t chunks, int threads, void (*fn)(void* ctx, int64_t c), void* ctx);

// The same with a callable (a lambda capturing by reference).
template <class F>
void parallel_for_chunks(int64_t chunks, int threads, const F& f) {
  parallel_chunks(chunks, threads, [](void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); },
                  const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace pds_cpu
