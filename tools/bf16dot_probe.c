#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <math.h>
#include <float.h>
static float f(uint32_t u){float x;memcpy(&x,&u,4);return x;}
static uint32_t u(float x){uint32_t v;memcpy(&v,&x,4);return v;}
static float bfz(uint16_t b){ if(!(b&0x7f80)) b&=0x8000; return f((uint32_t)b<<16);} /* DAZ */
__attribute__((target("avx512f,avx512bf16,avx512vl")))
static void hw(const float *acc, const uint32_t *a, const uint32_t *b, float *out){
  _mm512_storeu_ps(out,_mm512_dpbf16_ps(_mm512_loadu_ps(acc),(__m512bh)_mm512_loadu_si512(a),(__m512bh)_mm512_loadu_si512(b)));
}
int FLUSH_BEFORE=0, ORDER_ODD=1;
static float step(float acc, double p){
  double s=(double)acc+p;
  if (isfinite(s)) {
    double bb=s-acc, err=((double)acc-(s-bb))+(p-bb);
    if(err!=0){ uint64_t bits; memcpy(&bits,&s,8); if(!(bits&1)){ bits += ((s>0)==(err>0)) ? 1 : (uint64_t)-1; memcpy(&s,&bits,8);} }
  }
  if (FLUSH_BEFORE && fabs(s) < FLT_MIN) return copysignf(0.0f,(float)s);
  float r=(float)s;
  if(r!=0 && fabsf(r)<FLT_MIN) r=copysignf(0.0f,r);
  return r;
}
int AFIRST=1;
static float nanstep(float acc, uint16_t x, uint16_t w){
  const int xn=(x&0x7fff)>0x7f80, wn=(w&0x7fff)>0x7f80;
  uint16_t first = AFIRST ? x : w, second = AFIRST ? w : x; int fn = AFIRST ? xn : wn, sn = AFIRST ? wn : xn;
  if (fn) return f((uint32_t)(first|0x40)<<16);
  if (sn) return f((uint32_t)(second|0x40)<<16);
  if (isnan(acc)) return f(u(acc)|0x400000);
  float fx=bfz(x), fw=bfz(w);
  if ((isinf(fx)&&fw==0)||(isinf(fw)&&fx==0)) return f(0xffc00000u);
  double p=(double)fx*fw;
  if (isinf(acc)&&isinf(p)&&((acc>0)!=(p>0))) return f(0xffc00000u);
  return step(acc,p);
}
static float emu(float acc,uint32_t a,uint32_t b){
  if(fpclassify(acc)==FP_SUBNORMAL) acc=copysignf(0.0f,acc);
  return nanstep(nanstep(acc,a>>16,b>>16),a&0xffff,b&0xffff);
}
static uint64_t rs=88172645463325252ull; static uint64_t rnd(){rs^=rs<<13;rs^=rs>>7;rs^=rs<<17;return rs;}
static uint16_t rbf(int mode){
  uint16_t s=(rnd()&1)<<15; int e;
  switch(mode){case 0: e=127+(int)(rnd()%20)-10; break; case 1: e=(int)(rnd()%256); if(e<250 && rnd()%16==0) e=255; break;
   case 3: e=(int)(rnd()%12)+1+ (rnd()%2)*120; break; default: e=rnd()%4==0?0:(int)(rnd()%40)+1;}
  return s|(e<<7)|(rnd()&0x7f);
}
int main(int argc,char**argv){
  if(argc>1) FLUSH_BEFORE=atoi(argv[1]); if(argc>2) AFIRST=atoi(argv[2]);
  long mism[4]={0}, n[4]={0}; int shown=0;
  for(int it=0;it<400000;it++){
    float acc[16],out[16]; uint32_t a[16],b[16]; int mode=it%4;
    for(int i=0;i<16;i++){
      a[i]=rbf(mode)|(uint32_t)rbf(mode)<<16; b[i]=rbf(mode)|(uint32_t)rbf(mode)<<16;
      int kind=rnd()%5;
      float p1=f((uint32_t)(a[i]>>16)<<16)*f((uint32_t)(b[i]>>16)<<16), p0=f(a[i]<<16)*f(b[i]<<16);
      if(kind==0) acc[i]=-p1*(1+(float)(rnd()%8)*1e-7f);
      else if(kind==1) acc[i]=-p0*(1+(float)(rnd()%8)*1e-7f);
      else if(kind==2) acc[i]=f((uint32_t)(rnd()&0x807fffff)|((uint32_t)(rnd()%3)<<23));
      else if(kind==3) acc[i]=-(p0+p1)*(1+(float)(rnd()%5-2)*1e-7f);
      else acc[i]=f((uint32_t)rnd());
    }
    hw(acc,a,b,out);
    for(int i=0;i<16;i++){
      float e=emu(acc[i],a[i],b[i]); n[mode]++;
      if(u(e)!=u(out[i])){ mism[mode]++; if(shown++<15) printf("m%d acc=%a(%08x) a=%08x b=%08x hw=%a (%08x) emu=%a (%08x)\n",mode,acc[i],u(acc[i]),a[i],b[i],out[i],u(out[i]),e,u(e)); }
    }
  }
  for(int m=0;m<4;m++) printf("mode %d: %ld / %ld mismatches\n",m,mism[m],n[m]);
  /* borderline: acc = FLT_MIN, p1 = -2^-160 */
  float acc[16]={0},out[16]; uint32_t a[16]={0},b[16]={0};
  acc[0]=FLT_MIN; a[0]=(uint32_t)u(-0x1p-80f)&0xffff0000; b[0]=u(0x1p-80f)&0xffff0000;
  acc[1]=-FLT_MIN; a[1]=(uint32_t)u(0x1p-80f)&0xffff0000; b[1]=u(0x1p-80f)&0xffff0000;
  hw(acc,a,b,out); for(int i=0;i<2;i++) printf("border %d: hw=%a emu=%a\n",i,out[i],emu(acc[i],a[i],b[i]));
}
