#include "engine/kv/paged_kv_table.h"

#include <algorithm>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace specd {

PagedKvTable::PagedKvTable(int64_t block_tokens, int64_t capacity_tokens, int vocab_size,
                           int max_positions)
    : block_tokens_(block_tokens), vocab_size_(vocab_size), max_positions_(max_positions) {
  max_blocks_ = BlocksFor(capacity_tokens);
}

void PagedKvTable::AllocateUpFront() {
  // Reverse order: blocks are handed out in increasing order.
  for (int64_t b = max_blocks_ - 1; b >= allocated_blocks_; --b) {
    free_blocks_.push_back(static_cast<int32_t>(b));
  }
  allocated_blocks_ = max_blocks_;
}

int64_t PagedKvTable::FreeBlocks() const {
  return static_cast<int64_t>(free_blocks_.size()) + (max_blocks_ - allocated_blocks_);
}

int32_t PagedKvTable::AllocateBlock() {
  if (free_blocks_.empty()) {
    // Geometric growth, so a large capacity costs pool memory only when it is used.
    const int64_t grown =
        std::min(max_blocks_, std::max<int64_t>(allocated_blocks_ * 2, allocated_blocks_ + 4));
    // Reverse order: blocks are handed out in increasing order.
    for (int64_t b = grown - 1; b >= allocated_blocks_; --b) {
      free_blocks_.push_back(static_cast<int32_t>(b));
    }
    allocated_blocks_ = grown;
  }
  const int32_t b = free_blocks_.back();
  free_blocks_.pop_back();
  return b;
}

void PagedKvTable::ReleaseBlocks(Sequence* s, int64_t keep_blocks) {
  while (static_cast<int64_t>(s->blocks.size()) > keep_blocks) {
    free_blocks_.push_back(s->blocks.back());
    s->blocks.pop_back();
  }
}

int64_t PagedKvTable::PhysicalSlot(const Sequence& s, int64_t logical) const {
  return int64_t{s.blocks[logical / block_tokens_]} * block_tokens_ + logical % block_tokens_;
}

absl::Status PagedKvTable::AddSequence(SeqId seq) {
  if (seqs_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " already exists"));
  }
  if (FreeBlocks() == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache full: no free block for sequence ",
                                                     seq, " (capacity ",
                                                     max_blocks_ * block_tokens_, " tokens)"));
  }
  seqs_.emplace(seq, Sequence{});
  return absl::OkStatus();
}

absl::Status PagedKvTable::RemoveSequence(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  ReleaseBlocks(&it->second, 0);
  seqs_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PagedKvTable::CommittedLength(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  return it->second.committed;
}

absl::StatusOr<int64_t> PagedKvTable::ScratchLength(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  return static_cast<int64_t>(it->second.scratch_parents.size());
}

KvUsage PagedKvTable::Usage() const {
  KvUsage u;
  for (const auto& [id, s] : seqs_) u.used_tokens += s.tokens();
  u.capacity_tokens = max_blocks_ * block_tokens_;
  u.sequences = static_cast<int>(seqs_.size());
  return u;
}

absl::Status PagedKvTable::PrepareForward(absl::Span<const ForwardItem> items, StepLayout* layout) {
  absl::flat_hash_set<SeqId> seen;
  std::vector<Sequence*> seq_of(items.size());
  std::vector<std::vector<int32_t>> new_depth(items.size());
  int64_t blocks_needed = 0, total_tokens = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const ForwardItem& it = items[b];
    auto found = seqs_.find(it.seq);
    if (found == seqs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("items[", b, "].seq: sequence ", it.seq, " not found"));
    }
    if (!seen.insert(it.seq).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("items[", b, "].seq: sequence ", it.seq, " appears twice in one batch"));
    }
    Sequence& s = found->second;
    seq_of[b] = &s;
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat("items[", b, "].tokens is empty"));
    if (it.parents.size() != it.tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "items[", b, "].parents has ", it.parents.size(), " entries for ", n, " tokens"));
    }
    const int64_t base = static_cast<int64_t>(s.scratch_parents.size());
    new_depth[b].resize(n);
    for (int64_t j = 0; j < n; ++j) {
      const int32_t tok = it.tokens[j];
      if (tok < 0 || tok >= vocab_size_) {
        return absl::InvalidArgumentError(absl::StrCat("items[", b, "].tokens[", j, "] = ", tok,
                                                       " is outside the vocabulary [0, ",
                                                       vocab_size_, ")"));
      }
      const int32_t parent = it.parents[j];
      if (parent < -1 || parent >= base + j) {
        return absl::InvalidArgumentError(absl::StrCat("items[", b, "].parents[", j, "] = ", parent,
                                                       " must be -1 or an earlier scratch node (< ",
                                                       base + j, ")"));
      }
      const int32_t depth =
          parent < 0 ? 0
                     : 1 + (parent < base ? s.scratch_depth[parent] : new_depth[b][parent - base]);
      new_depth[b][j] = depth;
      if (s.committed + depth >= max_positions_) {
        return absl::InvalidArgumentError(
            absl::StrCat("items[", b, "].tokens[", j, "]: position ", s.committed + depth,
                         " is beyond the context (max_position_embeddings ", max_positions_, ")"));
      }
      if (mask_bits_ > 0) {
        // The node's deepest ancestor on the spine (the chain 0, 1, 2, ... from the committed
        // end): the mask covers the ancestors after it.
        const int32_t index = static_cast<int32_t>(base + j);
        const auto parent_of = [&](int32_t x) {
          return x < base ? s.scratch_parents[x] : it.parents[x - base];
        };
        const auto depth_of = [&](int32_t x) {
          return x < base ? s.scratch_depth[x] : new_depth[b][x - base];
        };
        int32_t a = index;
        while (a >= 0 && depth_of(a) != a) a = parent_of(a);
        if (index - a > mask_bits_) {
          return absl::UnimplementedError(absl::StrCat(
              "items[", b, "].parents[", j, "]: scratch node ", index, " lies ", index - a,
              " nodes past the chain from the committed end; the cuda backend masks at most ",
              mask_bits_));
        }
      }
    }
    for (int32_t r : it.logit_rows) {
      if (r < 0 || r >= n) {
        return absl::InvalidArgumentError(
            absl::StrCat("items[", b, "].logit_rows holds ", r, ", outside [0, ", n, ")"));
      }
    }
    blocks_needed += BlocksFor(s.tokens() + n) - static_cast<int64_t>(s.blocks.size());
    total_tokens += n;
  }
  if (blocks_needed > FreeBlocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: the batch needs ", blocks_needed * block_tokens_,
                     " more slots, ", FreeBlocks() * block_tokens_, " are free (capacity ",
                     max_blocks_ * block_tokens_, " tokens)"));
  }

  StepLayout& l = *layout;
  const int64_t T = total_tokens;
  l = StepLayout();
  l.num_tokens = T;
  l.num_seqs = static_cast<int64_t>(items.size());
  l.tokens.resize(T);
  l.positions.resize(T);
  l.slots.resize(T);
  l.query_seq.resize(T);
  l.prefix_len.resize(T);
  l.key_offsets.assign(T + 1, 0);
  if (mask_bits_ > 0) {
    l.committed.resize(items.size());
    l.scratch_parents.resize(items.size());
  }
  int64_t t = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const ForwardItem& it = items[b];
    Sequence& s = *seq_of[b];
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    if (mask_bits_ > 0) l.committed[b] = s.committed;
    while (static_cast<int64_t>(s.blocks.size()) < BlocksFor(s.tokens() + n)) {
      s.blocks.push_back(AllocateBlock());
    }
    l.max_blocks_per_seq = std::max<int64_t>(l.max_blocks_per_seq, s.blocks.size());
    for (int32_t r : it.logit_rows) l.logit_tokens.push_back(t + r);
    for (int64_t j = 0; j < n; ++j, ++t) {
      const int64_t scratch_index = static_cast<int64_t>(s.scratch_parents.size());
      s.scratch_parents.push_back(it.parents[j]);
      s.scratch_depth.push_back(new_depth[b][j]);
      l.tokens[t] = it.tokens[j];
      l.positions[t] = static_cast<int32_t>(s.committed + new_depth[b][j]);
      l.query_seq[t] = static_cast<int32_t>(b);
      l.slots[t] = PhysicalSlot(s, s.committed + scratch_index);
      // The keys are the node's ancestors (root first, itself last) after the committed prefix.
      // A scratch node whose depth equals its index has exactly scratch nodes 0..index as
      // ancestors, so the leading run of ancestors on that spine extends the prefix run (same
      // keys, same order) instead of being listed: a prefill chain costs O(1) metadata per token.
      const size_t start = l.tree_keys.size();
      int32_t a = static_cast<int32_t>(scratch_index);
      for (; a >= 0 && s.scratch_depth[a] != a; a = s.scratch_parents[a]) {
        l.tree_keys.push_back(static_cast<int32_t>(s.committed + a));
      }
      l.prefix_len[t] = static_cast<int32_t>(s.committed + a + 1);
      std::reverse(l.tree_keys.begin() + start, l.tree_keys.end());
      l.key_offsets[t + 1] = static_cast<int32_t>(l.tree_keys.size());
    }
  }
  if (mask_bits_ > 0) {
    for (size_t b = 0; b < items.size(); ++b) l.scratch_parents[b] = seq_of[b]->scratch_parents;
  }
  l.block_tables.assign(items.size() * l.max_blocks_per_seq, 0);
  for (size_t b = 0; b < items.size(); ++b) {
    std::copy(seq_of[b]->blocks.begin(), seq_of[b]->blocks.end(),
              l.block_tables.begin() + b * l.max_blocks_per_seq);
  }
  return absl::OkStatus();
}

absl::Status PagedKvTable::PrepareCommit(SeqId seq, absl::Span<const int32_t> path,
                                         std::vector<int64_t>* src, std::vector<int64_t>* dst) {
  src->clear();
  dst->clear();
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " not found"));
  Sequence& s = it->second;
  const int64_t scratch = static_cast<int64_t>(s.scratch_parents.size());
  for (size_t j = 0; j < path.size(); ++j) {
    if (path[j] < 0 || path[j] >= scratch) {
      return absl::InvalidArgumentError(absl::StrCat("path[", j, "] = ", path[j],
                                                     " is not a scratch node (sequence ", seq,
                                                     " has ", scratch, ")"));
    }
    const int32_t want = j == 0 ? -1 : path[j - 1];
    if (s.scratch_parents[path[j]] != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "path[", j, "] = ", path[j], " is not a child of ",
          j == 0 ? std::string("the committed end") : absl::StrCat("path[", j - 1, "]"),
          " (its parent is ", s.scratch_parents[path[j]], ")"));
    }
  }
  // path[j] >= j and increases, so copying in order never overwrites a later source.
  for (size_t j = 0; j < path.size(); ++j) {
    if (path[j] == static_cast<int32_t>(j)) continue;
    src->push_back(PhysicalSlot(s, s.committed + path[j]));
    dst->push_back(PhysicalSlot(s, s.committed + static_cast<int64_t>(j)));
  }
  s.committed += static_cast<int64_t>(path.size());
  s.scratch_parents.clear();
  s.scratch_depth.clear();
  ReleaseBlocks(&s, BlocksFor(s.committed));
  return absl::OkStatus();
}

}  // namespace specd
