/* A C program against the installed C ABI alone (ferry/ferry.h, -lferry_c):
 * saves one tensor, loads it back into zeroed memory and compares. */
#include <ferry/ferry.h>

#include <stdio.h>
#include <string.h>

static int failed(const char* what, ferry_status st) {
  fprintf(stderr, "%s: %s: %s\n", what, ferry_status_name(st), ferry_last_error());
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: c_consumer ROOT\n");
    return 2;
  }
  const ferry_kv settings[] = {{"root", argv[1]}, {"pool-bytes", "8MiB"}};
  ferry_runtime* rt = NULL;
  ferry_status st = ferry_runtime_create(settings, 2, 0, 1, &rt);
  if (st != FERRY_OK) return failed("create", st);

  float w[256], out[256];
  for (int i = 0; i < 256; ++i) w[i] = (float)i * 0.25f;
  memset(out, 0, sizeof(out));
  const int64_t shape[1] = {256};
  ferry_tensor t = {"w", w, FERRY_DTYPE_F32, 1, shape, NULL, FERRY_DEVICE_HOST, 0, NULL, NULL,
                    0,   0};
  ferry_save* s = NULL;
  st = ferry_save_async(rt, &t, 1, 7, NULL, 0, NULL, 0, &s);
  if (st != FERRY_OK) return failed("save", st);
  st = ferry_save_wait(s);
  ferry_save_release(s);
  if (st != FERRY_OK) return failed("wait", st);

  t.data = out;
  st = ferry_load(rt, &t, 1, argv[1]);
  if (st != FERRY_OK) return failed("load", st);
  ferry_runtime_destroy(rt);
  if (memcmp(w, out, sizeof(w)) != 0) {
    fprintf(stderr, "loaded bytes differ from the saved ones\n");
    return 1;
  }
  printf("c consumer: saved and loaded 1 tensor through libferry_c\n");
  return 0;
}
