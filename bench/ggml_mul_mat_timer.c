/* ggml-mul-mat-timer: time ggml's own CPU mul_mat, one run at a time, for bench/kquants.py.
 *
 * Compiled by bench/kquants.py against the same static ggml libraries as tests/oracle/ggml_op.c
 * (llama-server build 11434's), so the kernel timed is the one llama-server runs.
 *
 * Setup on stdin (little-endian): int32 type, int32 n_out, int32 n_in, int32 m, int32 n_threads,
 * int32 repacked (1: the weight in the CPU_REPACK buffer, as llama-server loads layer weights),
 * then the weight's GGUF block bytes and the activation (f32, m x n_in).
 * Then, per byte 'r' on stdin: one ggml_backend_graph_compute of y = W x; answers two float64:
 * its wall-clock seconds and the CPU seconds the process spent in it (all its threads). Byte 'o': the result (f32, m x n_out). EOF or 'q': exit.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

static void die(const char *msg) {
    fprintf(stderr, "ggml-mul-mat-timer: %s\n", msg);
    exit(2);
}

static void read_exact(void *dst, size_t n) {
    if (n && fread(dst, 1, n, stdin) != n) die("short read");
}

static double seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The buffer type the weight goes to: the CPU backend's first extra type (CPU_REPACK) or the
 * plain CPU one. */
static ggml_backend_buffer_type_t weight_buft(ggml_backend_t backend, int repacked) {
    if (!repacked) return ggml_backend_get_default_buffer_type(backend);
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    typedef ggml_backend_buffer_type_t *(*extra_bufts_t)(ggml_backend_dev_t);
    extra_bufts_t get_extra = (extra_bufts_t)ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t *extra = get_extra ? get_extra(dev) : NULL;
    if (!extra || !extra[0]) die("no CPU extra buffer type");
    return extra[0];
}

int main(void) {
    int32_t head[6];
    read_exact(head, sizeof head);
    const int32_t type = head[0], n_out = head[1], n_in = head[2], m = head[3], n_threads = head[4];
    ggml_cpu_init();
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    struct ggml_init_params ip = {.mem_size = 8 * ggml_tensor_overhead() + ggml_graph_overhead(),
                                  .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context *cw = ggml_init(ip), *cx = ggml_init(ip);
    struct ggml_tensor *w = ggml_new_tensor_2d(cw, (enum ggml_type)type, n_in, n_out);
    struct ggml_tensor *x = ggml_new_tensor_2d(cx, GGML_TYPE_F32, n_in, m);
    struct ggml_tensor *y = ggml_mul_mat(cx, w, x);
    ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, weight_buft(backend, head[5]));
    ggml_backend_buffer_set_usage(bw, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_t bx = ggml_backend_alloc_ctx_tensors(cx, backend);
    size_t wbytes = ggml_nbytes(w), xbytes = ggml_nbytes(x), ybytes = ggml_nbytes(y);
    char *data = malloc(wbytes > xbytes ? wbytes : xbytes);
    read_exact(data, wbytes);
    ggml_backend_tensor_set(w, data, 0, wbytes);
    read_exact(data, xbytes);
    ggml_backend_tensor_set(x, data, 0, xbytes);
    free(data);
    if (!ggml_backend_supports_op(backend, y)) die("the CPU backend does not take this product");
    struct ggml_cgraph *gf = ggml_new_graph(cx);
    ggml_build_forward_expand(gf, y);
    int c;
    while ((c = getchar()) != EOF && c != 'q') {
        if (c == 'r') {
            double wall = seconds(CLOCK_MONOTONIC), cpu = seconds(CLOCK_PROCESS_CPUTIME_ID);
            if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) die("compute failed");
            double spent[2] = {seconds(CLOCK_MONOTONIC) - wall, seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu};
            fwrite(spent, 8, 2, stdout);
        } else if (c == 'o') {
            char *out = malloc(ybytes);
            ggml_backend_tensor_get(y, out, 0, ybytes);
            fwrite(out, 1, ybytes, stdout);
            free(out);
        }
        fflush(stdout);
    }
    ggml_backend_buffer_free(bw);
    ggml_backend_buffer_free(bx);
    ggml_backend_free(backend);
    return 0;
}
