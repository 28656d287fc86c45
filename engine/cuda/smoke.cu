__global__ void AddOne(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}
void LaunchAddOne(float* x, int n) { AddOne<<<(n + 255) / 256, 256>>>(x, n); }
