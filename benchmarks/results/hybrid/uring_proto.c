// A C prototype (before sluice/io/uring.c): 806 O_DIRECT reads of 76 KiB a "token" (the issue-30 decode step's count and
// size) in batches of 20 (a layer's misses), by 8 threads each doing pread (preader.c's shape) or one io_uring,
// beside 0 or 2 compute threads; reports I/O time, the compute threads' rate against their rate with no I/O, and
// /proc/stat per token (steal: the hypervisor's time on our vCPUs).
//   gcc -O2 -pthread uring_proto.c -o /tmp/uring_proto && /tmp/uring_proto MODEL threads|uring TOKENS COMPUTE_THREADS
#define _GNU_SOURCE
#include <linux/io_uring.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>
#define NREAD 806
#define BATCH 20
#define SZ (76*1024)
static int fd; static off_t fsize; static char *bufs[NREAD]; static off_t offs[NREAD];
static atomic_long work; static atomic_int stop;
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static void *compute(void*a){ float *x=aligned_alloc(64,2<<20); for(int i=0;i<(512<<10);i++)x[i]=i*1e-6f;
  while(!stop){ float s=0; for(int i=0;i<(512<<10);i++){ s+=x[i]*x[(i*7)&((512<<10)-1)]; } x[0]=s*1e-9f; work++; } return NULL;}
// thread pool
static pthread_mutex_t mu=PTHREAD_MUTEX_INITIALIZER; static pthread_cond_t cv=PTHREAD_COND_INITIALIZER, dn=PTHREAD_COND_INITIALIZER;
static int head, tail, done_n, quit;
static void *worker(void*a){ for(;;){ pthread_mutex_lock(&mu); while(head==tail&&!quit) pthread_cond_wait(&cv,&mu);
  if(head==tail){pthread_mutex_unlock(&mu);break;} int i=head++; pthread_mutex_unlock(&mu);
  if(pread(fd,bufs[i],SZ,offs[i])!=SZ) {perror("pread"); exit(1);}
  pthread_mutex_lock(&mu); done_n++; pthread_cond_signal(&dn); pthread_mutex_unlock(&mu);} return NULL;}
// uring
static int rfd; static unsigned *sq_head,*sq_tail,*sq_mask,*sq_array,*cq_head,*cq_tail,*cq_mask; static struct io_uring_sqe *sqes; static struct io_uring_cqe *cqes;
static void uring_init(){ struct io_uring_params p; memset(&p,0,sizeof p); rfd=syscall(__NR_io_uring_setup,256,&p); if(rfd<0){perror("setup");exit(1);}
  size_t sl=p.sq_off.array+p.sq_entries*4, cl=p.cq_off.cqes+p.cq_entries*sizeof(struct io_uring_cqe);
  char *sq=mmap(0,sl,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_POPULATE,rfd,IORING_OFF_SQ_RING);
  char *cq=(p.features&IORING_FEAT_SINGLE_MMAP)?sq:mmap(0,cl,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_POPULATE,rfd,IORING_OFF_CQ_RING);
  if(p.features&IORING_FEAT_SINGLE_MMAP && cl>sl){ munmap(sq,sl); sq=cq=mmap(0,cl,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_POPULATE,rfd,IORING_OFF_SQ_RING);}
  sq_head=(void*)(sq+p.sq_off.head); sq_tail=(void*)(sq+p.sq_off.tail); sq_mask=(void*)(sq+p.sq_off.ring_mask); sq_array=(void*)(sq+p.sq_off.array);
  cq_head=(void*)(cq+p.cq_off.head); cq_tail=(void*)(cq+p.cq_off.tail); cq_mask=(void*)(cq+p.cq_off.ring_mask); cqes=(void*)(cq+p.cq_off.cqes);
  sqes=mmap(0,p.sq_entries*sizeof(struct io_uring_sqe),PROT_READ|PROT_WRITE,MAP_SHARED|MAP_POPULATE,rfd,IORING_OFF_SQES);}
static void uring_batch(int b0,int n){ unsigned t=*sq_tail; for(int i=0;i<n;i++){ unsigned idx=t&*sq_mask; struct io_uring_sqe*s=&sqes[idx]; memset(s,0,sizeof *s);
   s->opcode=IORING_OP_READ; s->fd=fd; s->addr=(unsigned long)bufs[b0+i]; s->len=SZ; s->off=offs[b0+i]; s->user_data=b0+i; sq_array[idx]=idx; t++; }
  __atomic_store_n(sq_tail,t,__ATOMIC_RELEASE);
  int got=0; int r=syscall(__NR_io_uring_enter,rfd,n,0,0,NULL,0); if(r!=n){perror("enter");exit(1);}
  while(got<n){ unsigned h=*cq_head; if(h==__atomic_load_n(cq_tail,__ATOMIC_ACQUIRE)){ syscall(__NR_io_uring_enter,rfd,0,1,IORING_ENTER_GETEVENTS,NULL,0); continue;}
    struct io_uring_cqe*c=&cqes[h&*cq_mask]; if(c->res!=SZ){fprintf(stderr,"res %d\n",c->res);exit(1);} got++; __atomic_store_n(cq_head,h+1,__ATOMIC_RELEASE);} }
static void steal(long *v){ FILE*f=fopen("/proc/stat","r"); char c[8]; fscanf(f,"%s",c); for(int i=0;i<8;i++) fscanf(f,"%ld",&v[i]); fclose(f);}
int main(int argc,char**argv){ const char*mode=argv[2]; int tokens=atoi(argv[3]); int ncomp=atoi(argv[4]);
  fd=open(argv[1],O_RDONLY|O_DIRECT); fsize=lseek(fd,0,SEEK_END); srand(1);
  for(int i=0;i<NREAD;i++){ bufs[i]=aligned_alloc(4096,SZ); memset(bufs[i],0,SZ);}
  pthread_t ct[2], wt[8]; for(int i=0;i<ncomp;i++) pthread_create(&ct[i],0,compute,0);
  if(!strcmp(mode,"threads")) for(int i=0;i<8;i++) pthread_create(&wt[i],0,worker,0); else if(!strcmp(mode,"uring")) uring_init();
  // baseline compute rate
  long w0=work; double t0=now(); usleep(500000); double base=(work-w0)/(now()-t0);
  long s0[8],s1[8]; steal(s0); w0=work; t0=now(); double io=0;
  for(int k=0;k<tokens;k++){ for(int i=0;i<NREAD;i++) offs[i]=((off_t)rand()*4096 % (fsize-SZ)) & ~4095L;
    for(int b=0;b<NREAD;b+=BATCH){ int n=NREAD-b<BATCH?NREAD-b:BATCH; double a=now();
      if(!strcmp(mode,"threads")){ pthread_mutex_lock(&mu); head=b; tail=b+n; done_n=0; pthread_cond_broadcast(&cv); while(done_n<n) pthread_cond_wait(&dn,&mu); pthread_mutex_unlock(&mu);}
      else uring_batch(b,n);
      io+=now()-a; } }
  double el=now()-t0; steal(s1); double rate=(work-w0)/el;
  printf("%s: %.1f ms/token I/O (%.2f GB/s), compute rate %.1f%% of its idle-I/O rate (%d threads); per token: steal %.1f ms, sys %.1f, softirq %.1f, idle %.1f, iowait %.1f\n",
    mode, io*1000/tokens, (double)NREAD*SZ*tokens/io/1e9, ncomp?100*rate/base:0, ncomp,
    (s1[7]-s0[7])*10.0/tokens,(s1[2]-s0[2])*10.0/tokens,(s1[6]-s0[6])*10.0/tokens,(s1[3]-s0[3])*10.0/tokens,(s1[4]-s0[4])*10.0/tokens);
  stop=1; quit=1; pthread_cond_broadcast(&cv); return 0;}
