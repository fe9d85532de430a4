// One-shot all-reduce of bf16 partial sums over NVLink peer memory, optionally fused with the
// residual add and RMSNorm that follow a row-parallel GEMM (O and down projections).
//
// Why not NCCL for these: a decode or verify step all-reduces a few KiB to a few hundred KiB
// twice a layer, where NCCL's fixed cost (~18 us on 2x H200) dominates. Here every rank reads
// all ranks' partials straight from their memory after one barrier, sums them in fp32 and, in
// the fused mode, updates the fp32 residual stream and writes the normalised bf16 row, all in
// one kernel. NCCL (engine/cuda/nccl_group.h) handles large messages and is the fallback.
// NVLink multicast (NVLS, cuMulticast*) is never used: it can take shared GPUs out of service.
//
// Determinism. Element (row, c) of the sum is ((in_0 + in_1) + in_2) + ... + in_{N-1} in fp32,
// in rank order, on every rank, so all ranks get the same bits; a row's results depend only on
// that row's inputs (and the residual row), never on `rows`, the grid or timing, which the
// batch/row invariance of speculative verification relies on. The fused norm is the arithmetic
// of RmsNormCuda on the fp32 residual, bit for bit (same per-thread partial sums of squares,
// same block reduction).
//
// Barrier. Each call site s (e.g. "attention output" and "FFN output") has, on every rank, an
// input buffer and a signal area of AllReduceSignalBytes(), zeroed once at allocation. Block b
// of a call keeps its call count in its own rank's signal area (no host-side counter, so a
// captured CUDA graph can be replayed any number of times), writes count+1 into flag [b][rank]
// of every rank's signal area (release, system scope), and waits until its own flags [b][p]
// equal count+1 for every rank p (acquire). Then it reads the inputs of its rows from all
// ranks. There is no barrier at the end; instead the caller keeps this contract:
//   1. Every rank calls the sites in the same order, with identical world_size, rows, dim,
//      mode (plain/fused) and max_blocks; only the pointers and `rank` differ.
//   2. A site is never used twice in a row: between two calls with site s every rank makes at
//      least one call with another site. That call's barrier proves every rank has finished
//      its previous call with s, reads of everyone's s inputs included, so whatever a rank
//      enqueues on its stream after its intervening call may overwrite its own s input with
//      the next partials. Two sites alternating suffice.
//   3. All blocks of all ranks' kernels of one call must be able to run at the same time:
//      the grid is capped (max_blocks), and when several ranks share one GPU (tests) their
//      kernels must run concurrently (separate streams, CUDA_DEVICE_MAX_CONNECTIONS at least
//      the number of streams) and their grids together must fit on the GPU.
// Every call, even one with rows == 0, takes part: in the barrier, or in push mode's call count.
//
// Push mode (messages of at most push_max_bytes: decode steps and small verify steps). The barrier's flag
// round trip and the read of the peers' partials cost two NVLink latencies; here each rank
// instead stores its partials straight into a mailbox slot on every peer and then waits on its
// own mailbox until the peers' values have landed, one latency in all. A mailbox slot is empty
// while it holds bf16 -0.0 in every element (the mailboxes start so: AllReduceMailboxInitCuda);
// a sender writes -0.0 as +0.0 (both modes sum every input that way, so the two modes give the
// same bits), and a receiver empties each slot again as soon as it has read it. Each site's
// mailbox has two phases that alternate from one push-mode call of the site to the next (a
// per-site count in the signal area, advanced by the call's last block): a peer can only write
// the same phase again two calls later, and it needs this rank's values of the call in between
// for that, which this rank sends only after it has emptied its slots. The contract above holds
// unchanged for push mode, which is also a valid "call with another site" for rule 2.
#ifndef SPECD_KERNELS_CUDA_ALLREDUCE_H_
#define SPECD_KERNELS_CUDA_ALLREDUCE_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

inline constexpr int kAllReduceMaxRanks = 8;
// The largest grid a call may use (the signal area holds flags for this many blocks), and the
// grid cap used when AllReduceParams::max_blocks is 0.
inline constexpr int kAllReduceMaxBlocks = 128;
inline constexpr int kAllReduceDefaultBlocks = 64;

// Bytes of one site's signal area on one rank (flags + per-block counters); zeroed once at
// allocation, then owned by the kernels. Its address must be 16-byte aligned.
int64_t AllReduceSignalBytes();

// Push mode's largest message. Measured on 2x H200 (bench/history/07-tp-run-01.md), push mode is faster up
// to 256 KiB (decode steps, small verify steps) and slower from 512 KiB on, with the fused
// norm: there every block's pushes and polls serialise. The mailboxes stay small (2 phases x
// N ranks x this, per site and rank).
inline constexpr int64_t kAllReducePushMaxBytes = int64_t{256} << 10;

// Bytes of one site's mailbox on one rank: two phases of one push_max_bytes slot per rank.
inline int64_t AllReduceMailboxBytes(int world_size, int64_t push_max_bytes) {
  return 2 * static_cast<int64_t>(world_size) * push_max_bytes;
}

// Fills `bytes` (a multiple of 16) at `mailbox` (16-byte aligned, device memory of the current
// device) with the empty pattern, bf16 -0.0. Once, before the first push-mode call.
cudaError_t AllReduceMailboxInitCuda(void* mailbox, int64_t bytes, cudaStream_t stream);

struct AllReduceParams {
  int world_size = 1;  // 1..kAllReduceMaxRanks
  int rank = 0;        // 0..world_size-1
  // inputs[r], r < world_size: [rows, dim] bf16, device memory of rank r, readable from this
  // rank's device (peer access, or the same device): rank r's partial sums for this call.
  // inputs[rank] is this rank's own. 16-byte aligned. None may alias `out` or `residual` of
  // any rank (other ranks may still be reading them while this rank writes its outputs).
  const bf16* inputs[kAllReduceMaxRanks] = {};
  // signals[r], r < world_size: this call's site's signal area on rank r
  // (AllReduceSignalBytes(), zeroed at allocation), writable from this rank's device.
  uint32_t* signals[kAllReduceMaxRanks] = {};
  int64_t rows = 0;  // >= 0
  // > 0 and a multiple of 8 (16-byte vectors; hidden sizes are multiples of 64).
  int64_t dim = 0;
  // Plain mode (residual == nullptr): out = sum (rounded to bf16).
  // Fused mode: residual = (residual_init ? 0 : residual) + sum, in fp32, then
  // out = RMSNorm(residual) * norm_weight with eps, exactly RmsNormCuda's arithmetic.
  bf16* out = nullptr;        // [rows, dim] bf16, device of this rank, 16-byte aligned
  float* residual = nullptr;  // [rows, dim] fp32, device of this rank, 16-byte aligned, or null
  bool residual_init = false;
  const float* norm_weight = nullptr;  // [dim] fp32, device of this rank; required in fused mode
  float eps = 1e-5f;
  // Push mode, used when rows * dim * 2 <= push_max_bytes: mailboxes[r], r < world_size,
  // is this site's mailbox on rank r (AllReduceMailboxBytes(world_size, push_max_bytes),
  // emptied by AllReduceMailboxInitCuda, 16-byte aligned), writable from this rank's device.
  // push_max_bytes: 0 (push mode off) or a multiple of 16, identical on every rank.
  bf16* mailboxes[kAllReduceMaxRanks] = {};
  int64_t push_max_bytes = 0;
  // Grid cap, identical on every rank: 0 means kAllReduceDefaultBlocks, else
  // 1..kAllReduceMaxBlocks. Rows (fused) or 16-byte vectors (plain) are strided over the
  // blocks. Lower it when ranks share a GPU so that all their blocks fit at once.
  int max_blocks = 0;
};

// Enqueues the all-reduce of this rank on `stream` (of this rank's device, which must be the
// current device). cudaErrorInvalidValue on a broken precondition (nothing is enqueued then,
// so the other ranks' calls would wait forever: validate before calling on any rank).
cudaError_t AllReduceCuda(const AllReduceParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_ALLREDUCE_H_
