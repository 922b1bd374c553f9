/* ggml-op: run ONE ggml operation on the CPU backend of the reference build, for bit-exact tests.
 *
 * tests/ggml_oracle.py compiles this file against the static ggml libraries that
 * scripts/build-llama-server.sh leaves in its build folder, so the arithmetic is that of the very
 * llama-server the tests compare with (same flags, same kernels, same thread split).
 *
 * Request on stdin (little-endian):
 *   char op[32]; int32 n_threads; float fp[8]; int32 ip[8]; int32 n_inputs;
 *   then per input: int32 type (-1: none); int64 ne[4]; int64 nbytes; nbytes of data (ggml layout).
 * Answer on stdout: int32 type; int64 ne[4]; int64 nbytes; data.  Errors: a message on stderr, exit 2.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#define MAX_INPUTS 8

static void die(const char *msg) {
    fprintf(stderr, "ggml-op: %s\n", msg);
    exit(2);
}

static void read_exact(void *dst, size_t n) {
    if (n && fread(dst, 1, n, stdin) != n) die("short read");
}

struct input {
    int32_t type;
    int64_t ne[4];
    int64_t nbytes;
    void *data;
};

static struct ggml_tensor *make_tensor(struct ggml_context *ctx, const struct input *in) {
    if (in->type < 0) return NULL;
    struct ggml_tensor *t = ggml_new_tensor_4d(ctx, (enum ggml_type)in->type, in->ne[0], in->ne[1],
                                               in->ne[2], in->ne[3]);
    if ((int64_t)ggml_nbytes(t) != in->nbytes) die("input size does not match its type and shape");
    memcpy(t->data, in->data, (size_t)in->nbytes);
    return t;
}

static struct ggml_tensor *build(struct ggml_context *ctx, const char *op, struct ggml_tensor **t,
                                 const float *fp, const int32_t *ip) {
    if (!strcmp(op, "mul_mat")) return ggml_mul_mat(ctx, t[0], t[1]);
    if (!strcmp(op, "flash_attn_ext")) return ggml_flash_attn_ext(ctx, t[0], t[1], t[2], t[3], fp[0], fp[1], fp[2]);
    if (!strcmp(op, "rope_ext"))
        return ggml_rope_ext(ctx, t[0], t[1], t[2], ip[0], ip[1], ip[2], fp[0], fp[1], fp[2], fp[3], fp[4], fp[5]);
    if (!strcmp(op, "swiglu")) return ggml_swiglu_split(ctx, t[0], t[1]);
    if (!strcmp(op, "geglu")) return ggml_geglu_split(ctx, t[0], t[1]);
    if (!strcmp(op, "silu")) return ggml_silu(ctx, t[0]);
    if (!strcmp(op, "gelu")) return ggml_gelu(ctx, t[0]);
    if (!strcmp(op, "rms_norm")) return ggml_rms_norm(ctx, t[0], fp[0]);
    /* rms_norm then mul by a weight row: the CPU backend fuses the pair, as in every llama layer */
    if (!strcmp(op, "rms_norm_mul")) return ggml_mul(ctx, ggml_rms_norm(ctx, t[0], fp[0]), t[1]);
    if (!strcmp(op, "mul")) return ggml_mul(ctx, t[0], t[1]);
    if (!strcmp(op, "add")) return ggml_add(ctx, t[0], t[1]);
    if (!strcmp(op, "scale")) return ggml_scale(ctx, t[0], fp[0]);
    if (!strcmp(op, "get_rows")) return ggml_get_rows(ctx, t[0], t[1]);
    if (!strcmp(op, "soft_max_ext")) return ggml_soft_max_ext(ctx, t[0], t[1], fp[0], fp[1]);
    if (!strcmp(op, "tanh")) return ggml_tanh(ctx, t[0]);
    /* a product by a Walsh-Hadamard matrix hinted as llama_mul_mat_hadamard does (the KV cache's
     * rotation): the CPU backend runs its fast transform, ggml_compute_forward_fwht */
    if (!strcmp(op, "fwht")) {
        struct ggml_tensor *res = ggml_mul_mat(ctx, t[0], t[1]);
        ggml_mul_mat_set_hint(res, GGML_HINT_SRC0_IS_HADAMARD);
        return res;
    }
    /* rows of t[0] (f32) stored at rows t[1] (i32) of a zeroed [ip[1] rows] tensor of type ip[0]:
     * ggml_set_rows, how llama.cpp writes K and V into its cache */
    if (!strcmp(op, "set_rows")) {
        struct ggml_tensor *dst = ggml_new_tensor_2d(ctx, (enum ggml_type)ip[0], t[0]->ne[0], ip[1]);
        memset(dst->data, 0, ggml_nbytes(dst));
        return ggml_set_rows(ctx, dst, t[0], t[1]);
    }
    if (!strcmp(op, "cpy")) {  /* convert t[0] to the type ip[0], as a cache store does */
        struct ggml_tensor *dst = ggml_new_tensor(ctx, (enum ggml_type)ip[0], 4, t[0]->ne);
        return ggml_cpy(ctx, t[0], dst);
    }
    die("unknown op");
    return NULL;
}

/* from_float of a type's CPU traits: how ggml rounds an activation row before a product */
static void quantize(const struct input *in, int32_t type) {
    const struct ggml_type_traits_cpu *traits = ggml_get_type_traits_cpu((enum ggml_type)type);
    if (!traits->from_float) die("no from_float for this type");
    int64_t n = in->nbytes / 4;
    int64_t rows = n / in->ne[0];
    size_t row_size = ggml_row_size((enum ggml_type)type, in->ne[0]);
    char *out = malloc(row_size * rows);
    for (int64_t r = 0; r < rows; r++)
        traits->from_float((const float *)in->data + r * in->ne[0], out + r * row_size, in->ne[0]);
    int64_t ne[4] = {in->ne[0], in->ne[1], in->ne[2], in->ne[3]};
    int64_t nbytes = (int64_t)(row_size * rows);
    fwrite(&type, 4, 1, stdout);
    fwrite(ne, 8, 4, stdout);
    fwrite(&nbytes, 8, 1, stdout);
    fwrite(out, 1, (size_t)nbytes, stdout);
    free(out);
}

/* mul_mat with the weight in the CPU backend's first extra buffer (CPU_REPACK), as llama-server
 * loads its layer weights: ggml_backend_tensor_set repacks it (e.g. Q4_0 -> q4_0_8x8) and the CPU
 * backend then computes the product with the repacked kernels. */
static void mul_mat_repacked(const struct input *in, int32_t n_threads) {
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    typedef ggml_backend_buffer_type_t *(*extra_bufts_t)(ggml_backend_dev_t);
    extra_bufts_t get_extra = (extra_bufts_t)ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t *extra = get_extra ? get_extra(dev) : NULL;
    if (!extra || !extra[0]) die("no CPU extra buffer type");
    struct ggml_init_params ip = {.mem_size = 8 * ggml_tensor_overhead() + ggml_graph_overhead(),
                                  .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context *cw = ggml_init(ip), *cx = ggml_init(ip);
    struct ggml_tensor *w = ggml_new_tensor_2d(cw, (enum ggml_type)in[0].type, in[0].ne[0], in[0].ne[1]);
    struct ggml_tensor *x = ggml_new_tensor_2d(cx, GGML_TYPE_F32, in[1].ne[0], in[1].ne[1]);
    if ((int64_t)ggml_nbytes(w) != in[0].nbytes || (int64_t)ggml_nbytes(x) != in[1].nbytes)
        die("input size does not match its type and shape");
    struct ggml_tensor *y = ggml_mul_mat(cx, w, x);
    ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, extra[0]);
    ggml_backend_buffer_set_usage(bw, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_t bx = ggml_backend_alloc_ctx_tensors(cx, backend);
    ggml_backend_tensor_set(w, in[0].data, 0, (size_t)in[0].nbytes);
    ggml_backend_tensor_set(x, in[1].data, 0, (size_t)in[1].nbytes);
    if (!ggml_backend_supports_op(backend, y)) die("the CPU backend does not take this product");
    struct ggml_cgraph *gf = ggml_new_graph(cx);
    ggml_build_forward_expand(gf, y);
    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) die("compute failed");
    int32_t type = y->type;
    int64_t nbytes = (int64_t)ggml_nbytes(y);
    char *out = malloc((size_t)nbytes);
    ggml_backend_tensor_get(y, out, 0, (size_t)nbytes);
    fwrite(&type, 4, 1, stdout);
    fwrite(y->ne, 8, 4, stdout);
    fwrite(&nbytes, 8, 1, stdout);
    fwrite(out, 1, (size_t)nbytes, stdout);
    free(out);
    ggml_backend_buffer_free(bw);
    ggml_backend_buffer_free(bx);
    ggml_backend_free(backend);
}

int main(void) {
    char op[33] = {0};
    int32_t n_threads, ip[8], n_inputs;
    float fp[8];
    read_exact(op, 32);
    read_exact(&n_threads, 4);
    read_exact(fp, sizeof fp);
    read_exact(ip, sizeof ip);
    read_exact(&n_inputs, 4);
    if (n_inputs < 0 || n_inputs > MAX_INPUTS) die("bad input count");
    struct input in[MAX_INPUTS] = {0};
    size_t total = 0;
    for (int i = 0; i < n_inputs; i++) {
        read_exact(&in[i].type, 4);
        read_exact(in[i].ne, 32);
        read_exact(&in[i].nbytes, 8);
        in[i].data = malloc((size_t)in[i].nbytes + 1);
        read_exact(in[i].data, (size_t)in[i].nbytes);
        total += (size_t)in[i].nbytes;
    }
    ggml_cpu_init();
    if (!strcmp(op, "quantize")) {
        quantize(&in[0], ip[0]);
        return 0;
    }
    if (!strcmp(op, "mul_mat_repacked")) {
        mul_mat_repacked(in, n_threads);
        return 0;
    }
    struct ggml_init_params params = {.mem_size = total * 4 + ((size_t)256 << 20), .mem_buffer = NULL,
                                      .no_alloc = false};
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *t[MAX_INPUTS] = {0};
    for (int i = 0; i < n_inputs; i++) t[i] = make_tensor(ctx, &in[i]);
    struct ggml_tensor *out = build(ctx, op, t, fp, ip);
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    if (ggml_graph_compute_with_ctx(ctx, gf, n_threads) != GGML_STATUS_SUCCESS) die("compute failed");
    int32_t type = out->type;
    int64_t nbytes = (int64_t)ggml_nbytes(out);
    fwrite(&type, 4, 1, stdout);
    fwrite(out->ne, 8, 4, stdout);
    fwrite(&nbytes, 8, 1, stdout);
    fwrite(out->data, 1, (size_t)nbytes, stdout);
    ggml_free(ctx);
    return 0;
}
