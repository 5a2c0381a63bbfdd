/* Causal attention forward and backward through flashback's C API. */
#include <stdio.h>

#include <flashback/flashback.h>

enum { B = 1, H = 2, S = 16, D = 32 }; /* batch, heads, sequence length, head dim */
enum { N = B * H * S * D };

/* [B, H, S, D] row-major; lse is [B, H, S] */
static float q[N], k[N], v[N], o[N], lse[B * H * S];
static float dout[N], dq[N], dk[N], dv[N];

static int check(fb_status status, const char* what) {
  if (status == FB_SUCCESS) return 0;
  fprintf(stderr, "%s failed: %s: %s\n", what, fb_status_name(status), fb_last_error());
  return 1;
}

int main(void) {
  for (int i = 0; i < N; ++i) {
    q[i] = (float)((i * 7) % 13 - 6) / 6.0f;
    k[i] = (float)((i * 5) % 11 - 5) / 5.0f;
    v[i] = (float)((i * 3) % 7 - 3) / 3.0f;
    dout[i] = 1.0f;
  }
  fb_tensor tq = fb_tensor_contiguous4(q, FB_F32, B, H, S, D);
  fb_tensor tk = fb_tensor_contiguous4(k, FB_F32, B, H, S, D);
  fb_tensor tv = fb_tensor_contiguous4(v, FB_F32, B, H, S, D);
  fb_tensor to = fb_tensor_contiguous4(o, FB_F32, B, H, S, D);
  fb_tensor tlse = fb_tensor_contiguous3(lse, FB_F32, B, H, S);
  fb_tensor tdout = fb_tensor_contiguous4(dout, FB_F32, B, H, S, D);
  fb_tensor tdq = fb_tensor_contiguous4(dq, FB_F32, B, H, S, D);
  fb_tensor tdk = fb_tensor_contiguous4(dk, FB_F32, B, H, S, D);
  fb_tensor tdv = fb_tensor_contiguous4(dv, FB_F32, B, H, S, D);

  fb_params params;
  fb_params_init(&params); /* always: it sets struct_size and the defaults */
  params.causal = 1;

  /* NULL, 0: the library allocates its workspace */
  if (check(fb_forward(&tq, &tk, &tv, &to, &tlse, &params, NULL, 0), "fb_forward")) return 1;
  if (check(fb_backward(&tdout, &tq, &tk, &tv, &to, &tlse, &tdq, &tdk, &tdv, NULL, &params, NULL, 0),
            "fb_backward"))
    return 1;

  printf("flashback %s on %s: o[0] = %.6f, lse[0] = %.6f, dq[%d] = %.6f\n", fb_version(), fb_cpu_isa(), o[0],
         lse[0], D, dq[D]);
  return 0;
}
