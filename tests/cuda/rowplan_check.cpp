// Host-side check of the cuda backend's row plan (fgcuda::plan_rows, csrc/cuda/apply.cu), built with nvcc and
// run without a GPU by tests/test_agc.py. Over Segs of every dtype, row lengths on both sides of each class
// limit, row starts at several offsets in a 16-byte window and row counts that leave last blocks part-full:
// the packed/split order, that every packed row's windows fit its team's registers (at each row's own start
// address, as the kernel computes them), and, walking the blocks as k_row_pass/locate find their rows, that
// every row (packed) or every chunk of a row (split) is taken by exactly one block.
#include "fastgrad_cuda.h"

#include <cstdint>
#include <cstdio>
#include <map>
#include <vector>

// apply.cu's probe() calls these (reduce.cu, amp.cu): not linked here, and never called.
namespace fgcuda {
int probe_reduce() { return 0; }
int probe_amp() { return 0; }
}  // namespace fgcuda

using namespace fgcuda;

static int failures = 0;
#define CHECK(cond, ...)                         \
  do {                                           \
    if (!(cond)) {                               \
      if (++failures <= 20) {                    \
        std::printf("FAIL %s: ", #cond);         \
        std::printf(__VA_ARGS__);                \
        std::printf("\n");                       \
      }                                          \
    }                                            \
  } while (0)

static int64_t elem_bytes(int32_t dt) { return dt == kF64 ? 8 : (dt == kF32 ? 4 : 2); }

// The kernel's window count of a row starting at addr (Windows<T> in apply.cu).
static int64_t windows_at(uintptr_t addr, int64_t n, int64_t size) {
  const int64_t e = 16 / size, mis = static_cast<int64_t>((addr & 15) / static_cast<uintptr_t>(size));
  return (n + mis + e - 1) / e;
}

// The device's search: the last Seg whose first_chunk <= b.
static int64_t seg_of_block(const std::vector<Seg>& s, int64_t b) {
  int64_t lo = 0, hi = static_cast<int64_t>(s.size()) - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (s[mid].first_chunk <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

static void check_plan(std::vector<Seg> segs) {
  const std::vector<Seg> orig = segs;
  RowPlan rp;
  const int64_t nb = plan_rows(segs.data(), static_cast<int64_t>(segs.size()), &rp);
  CHECK(nb == rp.nblocks, "return value");
  int64_t blocks = 0, split_rows = 0, packed_blocks = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(segs.size()); ++i) {
    const Seg& s = segs[i];
    const int64_t size = elem_bytes(s.dtype);
    CHECK(s.first_chunk == blocks, "seg %lld first_chunk %lld, expected %lld", (long long)i, (long long)s.first_chunk,
          (long long)blocks);
    bool fits = true;
    for (int64_t r = 0; r < s.rows && s.len > 0; ++r)
      fits = fits && windows_at(reinterpret_cast<uintptr_t>(s.ptr) + r * s.len * size, s.len, size) <= 2048;
    if (i < rp.split_seg0) {
      CHECK(s.team == 1 || s.team == 2 || s.team == 4 || s.team == 8 || s.team == 16 || s.team == 32 || s.team == 256,
            "team %d", s.team);
      CHECK(s.rpb > 0 && s.rpb % (256 / s.team) == 0, "rpb %d team %d", s.rpb, s.team);
      int64_t most = 0;
      for (int64_t r = 0; r < s.rows && s.len > 0; ++r) {
        const int64_t w = windows_at(reinterpret_cast<uintptr_t>(s.ptr) + r * s.len * size, s.len, size);
        CHECK(w <= int64_t(s.team) * 8, "len %lld row %lld: %lld windows, team %d", (long long)s.len, (long long)r,
              (long long)w, s.team);
        most = w > most ? w : most;
      }
      // the smallest team that holds the longest row (more lanes per row would only idle)
      CHECK(s.team == 1 || most > int64_t(s.team == 256 ? 32 : s.team / 2) * 8 || s.len == 0 || s.rows == 0,
            "len %lld: team %d for %lld windows", (long long)s.len, s.team, (long long)most);
      const int64_t n = (s.len > 0 && s.rows > 0) ? (s.rows + s.rpb - 1) / s.rpb : 0;
      blocks += n;
      packed_blocks += n;
    } else {
      CHECK(s.team == 0, "split seg with team %d", s.team);
      CHECK(!fits, "len %lld dtype %d: split although every row fits a block", (long long)s.len, s.dtype);
      CHECK(s.cpr == (s.len + kChunk - 1) / kChunk, "cpr");
      CHECK(s.first_row == split_rows, "first_row");
      blocks += s.rows * s.cpr;
      split_rows += s.rows;
    }
  }
  CHECK(blocks == rp.nblocks && packed_blocks == rp.npacked && split_rows == rp.nsplit_rows, "totals");
  // Every original Seg is in the plan once (stable order within each group).
  CHECK(segs.size() == orig.size(), "size");
  int64_t last_packed = -1, last_split = -1;
  for (size_t i = 0; i < segs.size(); ++i) {
    int64_t found = -1;
    for (size_t j = 0; j < orig.size(); ++j)
      if (orig[j].ptr == segs[i].ptr) found = static_cast<int64_t>(j);
    CHECK(found >= 0, "seg %zu lost", i);
    int64_t& last = static_cast<int64_t>(i) < rp.split_seg0 ? last_packed : last_split;
    CHECK(found > last, "order within a group changed");
    last = found;
  }
  // Walk the blocks as the kernels do.
  std::map<std::pair<int64_t, int64_t>, int> taken;  // (seg, row) for packed, (seg, row * cpr + piece) for split
  for (int64_t b = 0; b < rp.nblocks; ++b) {
    const int64_t i = seg_of_block(segs, b);
    const Seg& s = segs[i];
    CHECK((b < rp.npacked) == (s.team != 0), "block %lld in the wrong range", (long long)b);
    if (s.team != 0) {
      const int64_t nt = 256 / s.team, row0 = (b - s.first_chunk) * s.rpb;
      for (int k = 0; k < s.rpb / nt; ++k)
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t r = row0 + k * nt + t;
          if (r < s.rows) taken[{i, r}]++;
        }
    } else {
      const int64_t local = b - s.first_chunk, row = local / s.cpr, piece = local - row * s.cpr;
      CHECK(row < s.rows && piece * kChunk < s.len, "chunk out of range");
      taken[{i, local}]++;
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(segs.size()); ++i) {
    const Seg& s = segs[i];
    if (s.len == 0) continue;
    const int64_t units = s.team != 0 ? s.rows : s.rows * s.cpr;
    for (int64_t u = 0; u < units; ++u)
      CHECK((taken[{i, u}] == 1), "seg %lld (len %lld) unit %lld taken %d times", (long long)i, (long long)s.len,
            (long long)u, taken[{i, u}]);
  }
}

int main() {
  const int32_t dtypes[] = {kF32, kF16, kBF16, kF64};
  uintptr_t base = 0x100000000ull;
  for (int32_t dt : dtypes) {
    const int64_t size = elem_bytes(dt), e = 16 / size;
    const int64_t team = 4096 / size, block = 32768 / size;
    const int64_t lens[] = {0, 1, 2, e - 1, e, e + 1, 31, 32, 33, 8 * e, 8 * e + 1, team - 1, team, team + 1,
                            block - e, block - 1, block, block + 1, block + e, 3 * kChunk + 5};
    for (int64_t off : {int64_t(0), int64_t(1), e - 1}) {
      std::vector<Seg> segs;
      for (int64_t n : lens)
        for (int64_t rows : {int64_t(0), int64_t(1), int64_t(3), int64_t(37), int64_t(2500)}) {
          if (n * rows > (int64_t(1) << 22)) continue;
          Seg s{};
          s.ptr = reinterpret_cast<void*>(base + off * size);
          s.ptr2 = s.ptr;
          s.rows = rows;
          s.len = n;
          s.dtype = dt;
          s.dtype2 = dt;
          s.team = kPlanRows;
          segs.push_back(s);
          base += (static_cast<uintptr_t>(n * rows * size) + 4096) & ~static_cast<uintptr_t>(255);
        }
      check_plan(segs);
      // and one Seg alone (a table of one packed or one split tensor)
      for (const Seg& s : segs) check_plan({s});
    }
  }
  std::printf(failures ? "%d failures\n" : "ok\n", failures);
  return failures ? 1 : 0;
}
