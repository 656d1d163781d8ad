/* CRC-32C (crc32c.c): what the batched I/O (iopool.c) and the module's set-up use. */
#ifndef KVTIER_CRC32C_H
#define KVTIER_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Fills the tables and picks the build; once, at import, before any CRC is taken. */
void kvt_crc_init(void);

/* The build kvt_crc_init picked, "sse4.2" or "table" (the module's CRC32C_IMPL). */
const char *kvt_crc_impl_name(void);

/* CRC-32C of len bytes at p, continuing from seed (0 to start); needs no GIL. */
uint32_t kvt_crc32c(uint32_t seed, const void *p, size_t len);

#endif
