/* The sleeping worker team (team.c) that decode attention (decode_attention.c), prefill
 * attention (prefill_attention.c) and the quantized products (quant_matvec.c) share. */
#ifndef KVTIER_TEAM_H
#define KVTIER_TEAM_H

/* work(ctx) on the caller and on up to threads - 1 workers, without the GIL; returns
 * once all of them have left it. */
void kvt_team_run(void (*work)(void *), void *ctx, int threads);

#endif
