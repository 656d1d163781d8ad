/*
 * What the decode attention files share: decode_attention.c plans a call into units and
 * runs them on the team; a unit runs one of the builds, the portable one in
 * decode_attention.c or a hand-written one (decode_attention_avx512.c,
 * decode_attention_avx2.c), each reading the job below.
 */
#ifndef KVTIER_DECODE_ATTENTION_H
#define KVTIER_DECODE_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#define KVT_X86 1
#endif

#define ATTN_LANES 16
#define ATTN_MAX_GROUP 16
#define ATTN_MAX_DIM 256
#define ATTN_MAX_BLOCK 256

typedef struct {
    int seq, head, b0, b1; /* blocks [b0, b1) of the sequence's table */
} attn_unit_t;

typedef struct {
    const char *kv;                         /* the layer's pool */
    ptrdiff_t s_block, s_kv, s_head, s_pos; /* its strides, in elements */
    int bf16;     /* q and out are bfloat16, else float32 */
    int kind;     /* KVT_*: the pool's elements; 8-bit ones with a float32 scale per (block, K|V, head, row) */
    const float *scales;                    /* the layer's scales (8-bit): block b's at scales + b * ss_block */
    ptrdiff_t ss_block, ss_kv, ss_head;     /* their strides, in floats (a row's is 1) */
    const char *q; /* [num_seqs, kv_heads * group, dim], the model dtype */
    char *out;     /* the same shape and dtype */
    const int32_t *tables, *starts, *lengths;
    int num_seqs, kv_heads, group, dim, block;
    int window; /* a sliding-window layer's: a token sees its last `window` positions; 0: all */
    float scale;
    attn_unit_t *units;
    float *parts; /* per unit: m[group], l[group], acc[group * dim] */
    size_t n_units, part_floats;
    size_t next; /* the next unclaimed unit (atomic) */
} attn_job_t;

/* The first position sequence `seq` attends to: its window's start, 0 without one. Units
 * start at its block, and a unit's first block is read from that row on (attn_rows), so
 * nothing before the window is read: with windowed loads it may never have been loaded. */
static inline int attn_first(const attn_job_t *j, int seq) {
    const int len = j->lengths[seq];
    return j->window > 0 && len > j->window ? len - j->window : 0;
}

/* The K scales of rows [p0, ...) of pool block `id`, KV head `head` (V's follow at + ss_kv). */
static inline const float *attn_scales(const attn_job_t *j, int32_t id, int head, int p0) {
    return j->scales + (ptrdiff_t)id * j->ss_block + (ptrdiff_t)head * j->ss_head + p0;
}

/* Block b of a sequence whose positions run [first, len): the row it starts at and how many
 * rows it holds. */
static inline void attn_rows(int b, int block, int first, int len, int *p0, int *n) {
    const int start = b * block;
    *p0 = first > start ? first - start : 0;
    *n = (len - start < block ? len - start : block) - *p0;
}

#ifdef KVT_X86
/* The hand-written builds of one unit: the group's query heads against blocks [b0, b1)
 * of one sequence and KV head, into part = m[G], l[G], acc[G * D]. Call one only where
 * __builtin_cpu_supports says the CPU has its ISA. */
void kvt_attn_unit_avx512(const attn_job_t *j, const attn_unit_t *u, float *part);
void kvt_attn_unit_avx2(const attn_job_t *j, const attn_unit_t *u, float *part);
#endif

#endif
