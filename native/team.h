/* The sleeping worker team (team.c) that decode attention (decode_attention.c), prefill
 * attention (kvtier_prefill.c) and the quantized products (kvtier_quant.c) share. */
#ifndef KVTIER_TEAM_H
#define KVTIER_TEAM_H

/* work(ctx) on the caller and on up to threads - 1 workers, without the GIL; returns
 * once all of them have left it. */
void kvt_team_run(void (*work)(void *), void *ctx, int threads);

#endif
