/* The AVX2 integer-dot instruction pairs' peak on one core: 8 independent chains of maddubs + madd + add (the pair a
 * Q4_K sub-block's scale needs) and of maddubs + add16 (prompt_avx2.c's inner loop: int16 sums, one madd a sub-block
 * per token), from L1. The bound README quotes for the AVX2 prompt tiles.
 *
 *     gcc -O2 -mavx2 benchmarks/quantized/maddubs_peak.c -o /tmp/maddubs_peak && /tmp/maddubs_peak
 */
#include <stdio.h>
#include <time.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((aligned(64))) static signed char buf[32*64];
int main(int argc,char**argv){
  for(int i=0;i<32*64;i++) buf[i]=(i*7)%13;
  __m256i b=_mm256_set1_epi8(argc), s=_mm256_set1_epi16(argc);
  __m256i acc[8]; for(int j=0;j<8;j++){ acc[j]=_mm256_setzero_si256();}
  long m=100000000L; double t0=now();
  for(long i=0;i<m;i++){
    const __m256i *p=(const __m256i*)(buf+((i&7)*256));
#define STEP(j) { __m256i q=_mm256_maddubs_epi16(_mm256_load_si256(p+j),b); acc[j]=_mm256_add_epi32(acc[j],_mm256_madd_epi16(q,s)); }
    STEP(0)STEP(1)STEP(2)STEP(3)STEP(4)STEP(5)STEP(6)STEP(7)
  }
  double t1=now(); __m256i r=acc[0]; for(int j=1;j<8;j++) r=_mm256_add_epi32(r,acc[j]);
  printf("maddubs+madd+add: %.1f GMAC/s (%d)\n", 32.0*8*m/(t1-t0)/1e9, _mm256_extract_epi32(r,0));
  for(int j=0;j<8;j++){ acc[j]=_mm256_setzero_si256();}
  t0=now();
  for(long i=0;i<m;i++){
    const __m256i *p=(const __m256i*)(buf+((i&7)*256));
#define STEP2(j) { acc[j]=_mm256_add_epi16(acc[j],_mm256_maddubs_epi16(_mm256_load_si256(p+j),b)); }
    STEP2(0)STEP2(1)STEP2(2)STEP2(3)STEP2(4)STEP2(5)STEP2(6)STEP2(7)
  }
  t1=now(); r=acc[0]; for(int j=1;j<8;j++) r=_mm256_add_epi32(r,acc[j]);
  printf("maddubs+add16: %.1f GMAC/s (%d)\n", 32.0*8*m/(t1-t0)/1e9, _mm256_extract_epi32(r,0));
  return 0;}
