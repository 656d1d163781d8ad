/* The batched positional I/O pool (iopool.c): its sizes, which the module also exports
 * (THREADS, PIECE_BYTES), and its set-up. */
#ifndef KVTIER_IOPOOL_H
#define KVTIER_IOPOOL_H

/* Threads that serve one batch: the calling thread plus KVT_THREADS - 1 pool workers
 * (fewer than 32: seats are bits of an unsigned). */
#ifndef KVT_THREADS
#define KVT_THREADS 4
#endif
/* Aligned, unbounced requests are cut into pieces of at most this many bytes so that
 * one large buffer is still read by several threads. */
#ifndef KVT_PIECE
#define KVT_PIECE ((size_t)2 << 20)
#endif

/* Registers the pool's fork handlers (a child starts with no workers); once, at import. */
void kvt_iopool_init(void);

#endif
