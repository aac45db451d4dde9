/* Memory read bandwidth of this machine: 1 GiB read with N threads, 5 times (issue 14: is the resident decode
 * DRAM-bound?). The AVX2 adds only consume the loads.
 *
 *   gcc -O2 -mavx2 -pthread benchmarks/quantized/membw.c -o /tmp/membw && /tmp/membw 2
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static size_t N = (size_t)1 << 30; static char *buf; static int NT;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void *rd(void *a){ long i=(long)a; size_t per=N/NT; __m256i acc=_mm256_setzero_si256();
 for(size_t o=i*per;o<(i+1)*per;o+=32) acc=_mm256_add_epi64(acc,_mm256_load_si256((__m256i*)(buf+o)));
 long long r[4]; _mm256_storeu_si256((__m256i*)r,acc); return (void*)(r[0]+r[1]); }
int main(int c,char**v){NT=atoi(v[1]); buf=aligned_alloc(64,N); memset(buf,1,N);
 for(int rep=0;rep<5;rep++){double t=now(); pthread_t th[8]; for(long i=0;i<NT;i++)pthread_create(&th[i],0,rd,(void*)i); for(int i=0;i<NT;i++)pthread_join(th[i],0); printf("%d threads: %.1f GB/s\n",NT,N/(now()-t)/1e9);} }
