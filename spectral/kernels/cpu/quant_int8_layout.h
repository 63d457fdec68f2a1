// The integer path's weight layouts (`--quantization gguf-int8`), shared by its tiles
// (quant_int8_tiles.cpp) and its packers (quant_int8_pack.cpp); part of module.cpp's one
// translation unit, after quant_linear.cpp, whose layouts these extend. The weights are those
// layouts with the quants of each block regrouped (`pack_q8_layout`): for a group of 4
// consecutive inputs, each column's 4 quants side by side, so one 32-bit lane of a vector holds
// one column's 4 products.
// Q4_1: 4 groups of kNR x 4 bytes (low nibble: inputs 4g..4g+3, high nibble: 16 + 4g..);
// 8-bit layouts: 8 groups of kNR x 4 bytes.
//
// Q4_K has a layout of its own here, as compact as the file's (0.59 bytes a weight against
// Q4_1's 0.75): per panel, first each superblock's d and -dmin (kNR float32 each), then per
// block of 32 its 6-bit scale and minimum (kNR bytes each) and its regrouped nibbles; a block's
// dw = d * scale and mw = -dmin * min are made as the block is read (the same float32 products
// gguf_blocks' decoder makes, so the tiles' arithmetic is unchanged). Q6_K likewise (0.83 bytes a
// weight against Q8_0h's 1.25): per superblock d; per block the int8 scales of its two halves,
// the low 4 bits of its quants as Q4_K's nibbles, and their high 2 bits, a byte holding those of
// inputs 4g + t, 16 + 4g + t, 8 + 4g + t and 24 + 4g + t (g = 0, 1; bits 0-1, 2-3, 4-5, 6-7).
#pragma once

#include <string>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int kQ4_K = 4, kQ6_K = 5;  // the integer path's own layouts of Q4_K, Q6_K (above)
// Whether a layout's tile takes x quantized per superblock of 256 (quant_int8_k_tiles.cpp).
constexpr bool per_superblock(int kind) { return kind == kQ4_K || kind == kQ6_K; }
// Q4_1, Q8_0 and Q8_0m with their scales in float16 (kQ4_1 + kHalf, ...), where every scale is
// one exactly (those of Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 files): a fifth fewer bytes for Q4_1.
constexpr int kHalf = 6;
// Q5_0 and Q5_1 as compact as the file's (0.69 and 0.75 bytes a weight against 1.06 and 1.13 as
// Q8_0 / Q8_0m bytes): per block their float16 d (and m), the low 4 bits of the quants as Q4_1's
// nibbles, and the fifth bits, a byte for inputs 4g + t and 16 + 4g + t (g = 0..3: bits g and
// 4 + g) of a column (t = 0..3), laid out as one group's quants. Q5_0's quants less 16 are
// signed (the arithmetic of its Q8_0 form), Q5_1's unsigned with m (that of Q8_0m).
constexpr int kQ5_0 = 12, kQ5_1 = 13;
constexpr bool half_scales(int kind) { return kind >= kHalf; }
constexpr int quant_kind(int kind) {
  return kind >= kQ5_0 ? kind : half_scales(kind) ? kind - kHalf : kind;
}

constexpr int64_t q8_quants_offset(int kind) {
  return kind == kQ5_0 ? 2 * kNR
         : kind == kQ5_1 ? 4 * kNR
         : per_superblock(kind) ? 2 * kNR
         : half_scales(kind)             ? quants_offset(quant_kind(kind)) / 2
                                         : quants_offset(kind);
}
constexpr int64_t q8_block_bytes(int kind) {
  return kind == kQ5_0   ? 22 * kNR
         : kind == kQ5_1 ? 24 * kNR
         : kind == kQ4_K ? 18 * kNR
         : kind == kQ6_K   ? 26 * kNR
         : half_scales(kind) ? q8_quants_offset(kind) + packed_block_bytes(quant_kind(kind)) -
                                 quants_offset(quant_kind(kind))
                           : packed_block_bytes(kind);
}
// Bytes before a panel's first block: the superblocks' d (and -dmin).
constexpr int64_t q8_header_bytes(int kind, int64_t nb) {
  return kind == kQ4_K ? (nb / 8) * 8 * kNR : kind == kQ6_K ? (nb / 8) * 4 * kNR : 0;
}
// Where input j (0..31) of column c keeps its high 2 bits in a Q6_K block's high-bit bytes.
inline int64_t q6_high_offset(int64_t j, int64_t c) {
  return ((j % 16) / 4 % 2) * kNR * 4 + c * 4 + j % 4;
}
inline int q6_high_shift(int64_t j) { return ((j % 16) / 8) * 4 + (j / 16) * 2; }
// Where input j (0..31) of column c keeps its fifth bit in a Q5 block's high-bit bytes.
inline int64_t q5_high_offset(int64_t j, int64_t c) { return c * 4 + j % 4; }
inline int q5_high_shift(int64_t j) { return (j / 16) * 4 + (j % 16) / 4; }
constexpr int64_t q8_panel_bytes(int kind, int64_t nb) {
  return q8_header_bytes(kind, nb) + nb * q8_block_bytes(kind);
}
// "Q4_K", "Q6_K", a layout of quant_linear.cpp, or one of those with "f16" after it.
int q8_kind_of(const std::string& layout) {
  if (layout == "Q5_0" || layout == "Q5_1") return layout == "Q5_0" ? kQ5_0 : kQ5_1;
  const std::string base = strip_suffix(layout, "f16");
  if (!base.empty()) {
    const int kind = kind_of(base);
    TORCH_CHECK(kind != kQ8_0h, "Q8_0h has no float16-scale layout");
    return kind + kHalf;
  }
  return layout == "Q4_K" ? kQ4_K : layout == "Q6_K" ? kQ6_K : kind_of(layout);
}

// Byte offset, in a block's regrouped quants, of column c's quant of input j (Q4_1: j < 16,
// the byte that also holds input j + 16).
inline int64_t q8_offset(int64_t j, int64_t c) { return (j / 4) * kNR * 4 + c * 4 + j % 4; }

// The largest |quant| each 8-bit layout's int16 sums allow (quant_int8_tiles.cpp).
int32_t q8_bound(int kind) { return kind == kQ8_0m ? 31 : kind == kQ8_0h ? 32 : 128; }

}  // namespace

#pragma GCC pop_options
