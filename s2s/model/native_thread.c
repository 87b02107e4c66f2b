/* Each thread's blocks of memory, kept from call to call and freed when the thread ends: the
 * torch-free search (native_search.c) lays out a batch's buffers in block S2S_BLOCK_SEARCH, the
 * int8 products (native_int8.c) quantize their rows into block S2S_BLOCK_PRODUCTS.  Compiled into
 * s2s.native_search's library with them. */
#include <pthread.h>
#include <stdlib.h>

#define BLOCKS 2 /* S2S_BLOCK_SEARCH 0, S2S_BLOCK_PRODUCTS 1 */

typedef struct {
    void *p;
    size_t size;
} arena;

static pthread_key_t arena_key[BLOCKS];
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;

static void arena_free(void *a)
{
    if (a) {
        free(((arena *)a)->p);
        free(a);
    }
}

static void arena_keys_init(void)
{
    for (int i = 0; i < BLOCKS; i++)
        pthread_key_create(&arena_key[i], arena_free);
}

/* this thread's block ``which``, at least ``bytes`` long (64-byte aligned; its contents are not
 * kept when it grows); NULL where it cannot be allocated */
void *s2s_thread_block(int which, size_t bytes)
{
    if (which < 0 || which >= BLOCKS)
        return NULL;
    pthread_once(&arena_once, arena_keys_init);
    arena *a = pthread_getspecific(arena_key[which]);
    if (!a) {
        a = calloc(1, sizeof *a);
        if (!a || pthread_setspecific(arena_key[which], a)) {
            free(a);
            return NULL;
        }
    }
    if (a->size < bytes) {
        free(a->p);
        const size_t size = ((bytes + bytes / 4) + 63) & ~(size_t)63; /* room for a somewhat larger call */
        a->p = aligned_alloc(64, size);
        a->size = a->p ? size : 0;
    }
    return a->p;
}
