/* The SentencePiece-style BPE of a GGUF vocabulary (tokenizer.ggml.model = llama), as the
 * `tokenizers` library runs the backend npud/engine/gguf/tokenizer.py's assemble_backend builds:
 * the same ids for every text, the same text for every id list. npud/engine/tokenizer_native.py
 * builds this file into the kernel cache and calls it through ctypes (the GIL is released
 * for each call; nothing here is written after spm_new, so calls may run concurrently).
 *
 * What it reproduces, step by step:
 * - Added tokens (the vocabulary's control and user-defined tokens) are cut out of the raw
 *   text first, leftmost match first and the longest match at that position; the rest are
 *   pieces, and an empty piece is dropped.
 * - Each piece: spaces become U+2581. Not gemma: a piece that begins the text and does not
 *   start with U+2581 gets one in front (Metaspace, prepend scheme "first").
 * - A piece's characters: a character that is a token is its token; one that is not, its
 *   UTF-8 bytes as <0xNN> tokens when all of them are tokens; else the unknown token, and a
 *   run of unknown characters is one unknown token (a byte-fallback character in between
 *   neither ends the run nor is placed after it: the library emits the run when the next
 *   known character comes, or at the end). Without an unknown token the character is dropped.
 * - Merges: every adjacent pair that is a merge goes into a min-heap by (rank, position);
 *   the best is applied unless it is stale (its left symbol merged away, or the pair there
 *   is now another one), and the pairs it forms with its neighbours go in.
 * - A spelling held by several ids is the last id's; the others decode to nothing.
 * - Decode: U+2581 -> space per token; a run of <0xNN> tokens becomes its bytes when they are
 *   valid UTF-8, else one U+FFFD per byte token; not gemma: one leading space is dropped.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t n_tokens;
    const int32_t *offsets;   /* [n_tokens + 1] into blob */
    const uint8_t *blob;      /* the token spellings, UTF-8 */
    int32_t n_merges;
    const int32_t *merges;    /* [n_merges][3]: left id, right id, merged id; rank = row */
    int32_t *vocab;           /* open addressing: spelling -> id (the last of its spelling) */
    uint64_t vocab_mask;
    int32_t *pairs;           /* open addressing: (left, right) -> row of merges (the last) */
    uint64_t pairs_mask;
    int32_t byte_ids[256];    /* <0xNN> -> id, or -1 */
    int32_t unk;              /* the unknown token's id, or -1 */
    int gemma;
    /* the added tokens: a byte trie, (node << 8 | byte) -> child node, and each node's token */
    uint64_t *trie_keys;
    int32_t *trie_child;
    uint64_t trie_mask;
    int32_t *node_token;      /* [n_nodes]: the added token ending here, or -1 */
    int32_t n_nodes;
    uint8_t first_byte[256];  /* bytes an added token may start with */
} spm;

static uint64_t hash_bytes(const uint8_t *s, int64_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (int64_t i = 0; i < n; i++) { h ^= s[i]; h *= 1099511628211ULL; }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static uint64_t table_size(int64_t n) {
    uint64_t size = 16;
    while (size < (uint64_t)n * 2) size <<= 1;
    return size;
}

static int32_t lookup(const spm *t, const uint8_t *s, int64_t n) {
    for (uint64_t i = hash_bytes(s, n) & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        int32_t id = t->vocab[i];
        if (id < 0) return -1;
        int64_t len = t->offsets[id + 1] - t->offsets[id];
        if (len == n && memcmp(t->blob + t->offsets[id], s, (size_t)n) == 0) return id;
    }
}

static int32_t merge_row(const spm *t, int32_t left, int32_t right) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (uint64_t i = hash_u64(key) & t->pairs_mask;; i = (i + 1) & t->pairs_mask) {
        int32_t row = t->pairs[i];
        if (row < 0) return -1;
        if (t->merges[3 * row] == left && t->merges[3 * row + 1] == right) return row;
    }
}

static int32_t trie_step(const spm *t, int32_t node, uint8_t byte) {
    uint64_t key = (uint64_t)node << 8 | byte;
    for (uint64_t i = hash_u64(key + 1) & t->trie_mask;; i = (i + 1) & t->trie_mask) {
        if (t->trie_child[i] < 0) return -1;
        if (t->trie_keys[i] == key) return t->trie_child[i];
    }
}

void spm_free(spm *t) {
    if (!t) return;
    free(t->vocab); free(t->pairs); free(t->trie_keys); free(t->trie_child); free(t->node_token);
    free(t);
}

/* The tables over arrays the caller keeps alive (and unchanged) until spm_free. `added`: token
 * indices of the added tokens; `unk`: a token index or -1. NULL when out of memory. */
spm *spm_new(int32_t n_tokens, const int32_t *offsets, const uint8_t *blob, int32_t n_merges,
             const int32_t *merges, int32_t n_added, const int32_t *added, int32_t unk, int gemma) {
    spm *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->n_tokens = n_tokens; t->offsets = offsets; t->blob = blob;
    t->n_merges = n_merges; t->merges = merges; t->gemma = gemma;
    uint64_t vsize = table_size(n_tokens), psize = table_size(n_merges);
    t->vocab = malloc(vsize * sizeof *t->vocab);
    t->pairs = malloc(psize * sizeof *t->pairs);
    int64_t added_bytes = 1;
    for (int32_t k = 0; k < n_added; k++) added_bytes += offsets[added[k] + 1] - offsets[added[k]];
    uint64_t tsize = table_size(added_bytes);
    t->trie_keys = malloc(tsize * sizeof *t->trie_keys);
    t->trie_child = malloc(tsize * sizeof *t->trie_child);
    t->node_token = malloc((size_t)added_bytes * sizeof *t->node_token);
    if (!t->vocab || !t->pairs || !t->trie_keys || !t->trie_child || !t->node_token) { spm_free(t); return NULL; }
    t->vocab_mask = vsize - 1; t->pairs_mask = psize - 1; t->trie_mask = tsize - 1;
    memset(t->vocab, 0xff, vsize * sizeof *t->vocab);
    memset(t->pairs, 0xff, psize * sizeof *t->pairs);
    memset(t->trie_child, 0xff, tsize * sizeof *t->trie_child);

    for (int32_t id = 0; id < n_tokens; id++) {  /* in id order, so a repeated spelling ends as the last id */
        const uint8_t *s = blob + offsets[id];
        int64_t n = offsets[id + 1] - offsets[id];
        uint64_t i = hash_bytes(s, n) & t->vocab_mask;
        for (;; i = (i + 1) & t->vocab_mask) {
            int32_t other = t->vocab[i];
            if (other < 0) break;
            if (offsets[other + 1] - offsets[other] == n && memcmp(blob + offsets[other], s, (size_t)n) == 0) break;
        }
        t->vocab[i] = id;
    }
    for (int32_t row = 0; row < n_merges; row++) {  /* a repeated pair keeps its last row */
        uint64_t key = (uint64_t)(uint32_t)merges[3 * row] << 32 | (uint32_t)merges[3 * row + 1];
        uint64_t i = hash_u64(key) & t->pairs_mask;
        for (;; i = (i + 1) & t->pairs_mask) {
            int32_t other = t->pairs[i];
            if (other < 0 || (merges[3 * other] == merges[3 * row] && merges[3 * other + 1] == merges[3 * row + 1])) break;
        }
        t->pairs[i] = row;
    }
    for (int b = 0; b < 256; b++) {
        static const char hex[] = "0123456789ABCDEF";
        uint8_t code[6] = {'<', '0', 'x', (uint8_t)hex[b >> 4], (uint8_t)hex[b & 15], '>'};
        t->byte_ids[b] = lookup(t, code, 6);
    }
    t->unk = unk < 0 ? -1 : lookup(t, blob + offsets[unk], offsets[unk + 1] - offsets[unk]);

    t->n_nodes = 1;
    t->node_token[0] = -1;
    for (int32_t k = 0; k < n_added; k++) {
        const uint8_t *s = blob + offsets[added[k]];
        int64_t n = offsets[added[k] + 1] - offsets[added[k]];
        if (n == 0) continue;  /* the library ignores an empty added token */
        t->first_byte[s[0]] = 1;
        int32_t node = 0;
        for (int64_t j = 0; j < n; j++) {
            int32_t child = trie_step(t, node, s[j]);
            if (child < 0) {
                uint64_t key = (uint64_t)node << 8 | s[j];
                uint64_t i = hash_u64(key + 1) & t->trie_mask;
                while (t->trie_child[i] >= 0) i = (i + 1) & t->trie_mask;
                child = t->n_nodes++;
                t->node_token[child] = -1;
                t->trie_keys[i] = key;
                t->trie_child[i] = child;
            }
            node = child;
        }
        t->node_token[node] = lookup(t, s, n);  /* its id is the vocabulary's for that spelling */
    }
    return t;
}

/* ---- encode ---------------------------------------------------------------------------------- */

typedef struct { int32_t id, prev, next, len; } symbol;
typedef struct { int32_t rank, pos, new_id; } merge;

static int merge_before(merge a, merge b) { return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos; }

static void heap_push(merge *heap, int64_t *n, merge m) {
    int64_t i = (*n)++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!merge_before(m, heap[parent])) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = m;
}

static merge heap_pop(merge *heap, int64_t *n) {
    merge top = heap[0], last = heap[--(*n)];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= *n) break;
        if (child + 1 < *n && merge_before(heap[child + 1], heap[child])) child++;
        if (!merge_before(heap[child], last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (*n > 0) heap[i] = last;
    return top;
}

static int utf8_width(uint8_t lead) {
    return lead < 0x80 ? 1 : lead < 0xe0 ? 2 : lead < 0xf0 ? 3 : 4;
}

static void add_symbol(symbol *syms, int64_t *n, int32_t id, int32_t len) {
    int64_t k = (*n)++;
    syms[k].id = id; syms[k].len = len; syms[k].next = -1;
    syms[k].prev = (int32_t)(k - 1);
    if (k > 0) syms[k - 1].next = (int32_t)k;
}

static void push_pair(const spm *t, const symbol *syms, merge *heap, int64_t *nheap, int32_t pos, int32_t right) {
    int32_t row = merge_row(t, syms[pos].id, syms[right].id);
    if (row >= 0) heap_push(heap, nheap, (merge){row, pos, t->merges[3 * row + 2]});
}

/* The ids of one normalized piece `s` appended to out; returns how many, or -1 (out of memory).
 * A symbol holds at least one byte, and each merge pops an entry and pushes at most two, so
 * the heap never holds more than twice the bytes. */
static int64_t bpe(const spm *t, const uint8_t *s, int64_t n, int32_t *out) {
    symbol *syms = malloc((size_t)(n + 1) * sizeof *syms);
    merge *heap = malloc((size_t)(n + 1) * 2 * sizeof *heap);
    if (!syms || !heap) { free(syms); free(heap); return -1; }
    int64_t nsym = 0, nheap = 0;
    int32_t unk_len = 0;  /* a pending (fused) run of unknown characters */
    for (int64_t i = 0; i < n;) {
        int w = utf8_width(s[i]);
        if (i + w > n) w = (int)(n - i);
        int32_t id = lookup(t, s + i, w);
        if (id >= 0) {
            if (unk_len) { add_symbol(syms, &nsym, t->unk, unk_len); unk_len = 0; }
            add_symbol(syms, &nsym, id, w);
        } else {
            int all = 1;
            for (int j = 0; j < w; j++) all &= t->byte_ids[s[i + j]] >= 0;
            if (all) {
                for (int j = 0; j < w; j++) add_symbol(syms, &nsym, t->byte_ids[s[i + j]], 1);
            } else if (t->unk >= 0) {
                unk_len += w;
            }
        }
        i += w;
    }
    if (unk_len) add_symbol(syms, &nsym, t->unk, unk_len);

    for (int32_t i = 0; i + 1 < nsym; i++) push_pair(t, syms, heap, &nheap, i, i + 1);
    while (nheap > 0) {
        merge top = heap_pop(heap, &nheap);
        symbol *cur = &syms[top.pos];
        if (cur->len == 0 || cur->next == -1) continue;
        int32_t next_pos = cur->next;
        symbol right = syms[next_pos];
        int32_t row = merge_row(t, cur->id, right.id);
        if (row < 0 || t->merges[3 * row + 2] != top.new_id) continue;  /* stale: the pair here changed */
        cur->id = top.new_id;
        cur->len += right.len;
        cur->next = right.next;
        syms[next_pos].len = 0;
        if (right.next >= 0) syms[right.next].prev = top.pos;
        if (cur->prev >= 0) push_pair(t, syms, heap, &nheap, cur->prev, top.pos);
        if (cur->next >= 0) push_pair(t, syms, heap, &nheap, top.pos, cur->next);
    }
    int64_t count = 0;
    for (int64_t i = 0; i < nsym; i++)
        if (syms[i].len) out[count++] = syms[i].id;
    free(syms);
    free(heap);
    return count;
}

/* A piece of the text (`offset` its start in it), normalized and run through the BPE. */
static int64_t piece(const spm *t, const uint8_t *s, int64_t n, int64_t offset, uint8_t *buf, int32_t *out) {
    if (n == 0) return 0;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (s[i] == ' ') { buf[m++] = 0xe2; buf[m++] = 0x96; buf[m++] = 0x81; }
        else buf[m++] = s[i];
    }
    const uint8_t *word = buf;
    if (!t->gemma && offset == 0 && !(m >= 3 && buf[0] == 0xe2 && buf[1] == 0x96 && buf[2] == 0x81)) {
        memmove(buf + 3, buf, (size_t)m);
        buf[0] = 0xe2; buf[1] = 0x96; buf[2] = 0x81;
        m += 3;
    }
    return bpe(t, word, m, out);
}

/* The longest added token starting at s[0] (its length in bytes, its id in *id), or 0. */
static int64_t added_at(const spm *t, const uint8_t *s, int64_t n, int32_t *id) {
    int32_t node = 0;
    int64_t best = 0;
    for (int64_t j = 0; j < n; j++) {
        node = trie_step(t, node, s[j]);
        if (node < 0) break;
        if (t->node_token[node] >= 0) { best = j + 1; *id = t->node_token[node]; }
    }
    return best;
}

/* Upper bound of the ids spm_encode writes for `len` bytes of text (a space may become the
 * three byte tokens of U+2581). */
int64_t spm_encode_bound(int64_t len) { return 3 * len + 8; }

/* The ids of the UTF-8 `text` into out (room for spm_encode_bound(len)): `bos` (an id, or -1)
 * in front; with `split_added`, the added tokens cut out first. Returns how many, or -1 (out
 * of memory). */
int64_t spm_encode(const spm *t, const uint8_t *text, int64_t len, int split_added, int32_t bos, int32_t *out) {
    uint8_t *buf = malloc((size_t)(3 * len + 4));
    if (!buf) return -1;
    int64_t count = 0, start = 0;
    if (bos >= 0) out[count++] = bos;
    if (split_added) {
        for (int64_t i = 0; i < len;) {
            int32_t id;
            int64_t m = t->first_byte[text[i]] ? added_at(t, text + i, len - i, &id) : 0;
            if (!m) { i++; continue; }
            int64_t got = piece(t, text + start, i - start, start, buf, out + count);
            if (got < 0) { free(buf); return -1; }
            count += got;
            out[count++] = id;
            i += m;
            start = i;
        }
    }
    int64_t got = piece(t, text + start, len - start, start, buf, out + count);
    free(buf);
    return got < 0 ? -1 : count + got;
}

/* ---- lookups and decode ----------------------------------------------------------------------- */

int32_t spm_token_to_id(const spm *t, const uint8_t *s, int64_t n) { return lookup(t, s, n); }

/* out[k] = the id of token index indices[k]'s spelling (the last id of a repeated spelling). */
void spm_ids_of(const spm *t, const int32_t *indices, int64_t n, int32_t *out) {
    for (int64_t k = 0; k < n; k++)
        out[k] = lookup(t, t->blob + t->offsets[indices[k]], t->offsets[indices[k] + 1] - t->offsets[indices[k]]);
}

/* known[id] = 1 for the ids a spelling maps back to (the others decode to nothing). */
void spm_known(const spm *t, uint8_t *known) {
    for (int32_t id = 0; id < t->n_tokens; id++)
        known[id] = lookup(t, t->blob + t->offsets[id], t->offsets[id + 1] - t->offsets[id]) == id;
}

static int is_hex(uint8_t c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
static int hex_value(uint8_t c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; }

/* The byte a spelling like <0xNN> stands for (as the library parses it: two hex digits, or
 * '+' and one), or -1. */
static int byte_token(const uint8_t *s, int64_t n) {
    if (n != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>') return -1;
    if (is_hex(s[3]) && is_hex(s[4])) return hex_value(s[3]) * 16 + hex_value(s[4]);
    if (s[3] == '+' && is_hex(s[4])) return hex_value(s[4]);
    return -1;
}

/* Whether s[0..n) is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF). */
static int valid_utf8(const uint8_t *s, int64_t n) {
    for (int64_t i = 0; i < n;) {
        uint8_t c = s[i];
        int w;
        uint32_t lo = 0x80, hi = 0xbf;
        if (c < 0x80) { i++; continue; }
        else if (c >= 0xc2 && c <= 0xdf) w = 2;
        else if (c >= 0xe0 && c <= 0xef) { w = 3; if (c == 0xe0) lo = 0xa0; if (c == 0xed) hi = 0x9f; }
        else if (c >= 0xf0 && c <= 0xf4) { w = 4; if (c == 0xf0) lo = 0x90; if (c == 0xf4) hi = 0x8f; }
        else return 0;
        if (i + w > n || s[i + 1] < lo || s[i + 1] > hi) return 0;
        for (int j = 2; j < w; j++)
            if (s[i + j] < 0x80 || s[i + j] > 0xbf) return 0;
        i += w;
    }
    return 1;
}

/* Upper bound of the bytes spm_decode writes for these ids. */
int64_t spm_decode_bound(const spm *t, const int32_t *ids, int64_t n) {
    int64_t bound = 0;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < t->n_tokens) bound += t->offsets[ids[i] + 1] - t->offsets[ids[i]] + 3;
    return bound;
}

static int64_t flush_bytes(const uint8_t *run, int64_t nrun, uint8_t *out, int64_t at) {
    if (valid_utf8(run, nrun)) { memcpy(out + at, run, (size_t)nrun); return at + nrun; }
    for (int64_t i = 0; i < nrun; i++) { out[at++] = 0xef; out[at++] = 0xbf; out[at++] = 0xbd; }
    return at;
}

/* The UTF-8 text of `ids` (each in [0, n_tokens)) into out (room for spm_decode_bound); returns
 * its length. An id whose spelling is another id's decodes to nothing. */
int64_t spm_decode(const spm *t, const int32_t *ids, int64_t n, uint8_t *out) {
    int64_t at = 0, nrun = 0;
    uint8_t tmp[8];
    /* pending byte tokens, in the tail: the text before them is at most the spellings so far,
     * and each id's bound has 3 spare bytes, so text never reaches it */
    uint8_t *run = out + spm_decode_bound(t, ids, n) - n;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        const uint8_t *s = t->blob + t->offsets[id];
        int64_t len = t->offsets[id + 1] - t->offsets[id];
        if (lookup(t, s, len) != id) continue;
        int64_t m = 0;  /* the spelling with U+2581 as spaces: only a 6-byte result can be a byte token */
        int b = -1;
        if (len <= 8) {
            for (int64_t j = 0; j < len; j++) {
                if (j + 2 < len && s[j] == 0xe2 && s[j + 1] == 0x96 && s[j + 2] == 0x81) { tmp[m++] = ' '; j += 2; }
                else tmp[m++] = s[j];
            }
            b = byte_token(tmp, m);
        }
        if (b >= 0) { run[nrun++] = (uint8_t)b; continue; }
        if (nrun) { at = flush_bytes(run, nrun, out, at); nrun = 0; }
        for (int64_t j = 0; j < len; j++) {
            if (j + 2 < len && s[j] == 0xe2 && s[j + 1] == 0x96 && s[j + 2] == 0x81) { out[at++] = ' '; j += 2; }
            else out[at++] = s[j];
        }
    }
    if (nrun) at = flush_bytes(run, nrun, out, at);
    if (!t->gemma && at > 0 && out[0] == ' ') { memmove(out, out + 1, (size_t)(at - 1)); at--; }
    return at;
}
